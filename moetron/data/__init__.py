"""Real training data: `moetron data prepare` and the memory-mapped packed dataset the trainer reads.

    moetron data prepare corpus/ more.jsonl.gz --tokenizer tokenizer.json --output data/my-corpus
    moetron train --set train.data=data/my-corpus --set model.vocab_size=...

A prepared folder holds `tokens.bin` (documents back to back, each followed by the separator
token; uint16 or uint32 by vocabulary size), `doc_index.bin` (int64 document offsets),
`tokenizer.json` (the tokenizer used) and `meta.json` (written last; it marks the folder
complete). See `moetron.data.prepare` and `moetron.data.packed` for the details.
"""

from moetron.data.packed import FeistelPermutation, PackedBatches, PreparedCorpus
from moetron.data.prepare import PrepareSummary, is_prepared, load_tokenizer

# The function is `moetron.data.prepare.prepare`; not re-exported here, where its name would
# hide the submodule `moetron.data.prepare`.
__all__ = ["FeistelPermutation", "PackedBatches", "PreparedCorpus", "PrepareSummary", "is_prepared",
           "load_tokenizer"]
