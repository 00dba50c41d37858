"""Use moetron's layers inside other codebases.

`moetron.integrations.transformers.patch(model)` swaps the MoE blocks of a loaded Hugging Face transformers
model for moetron `MoELayer`s that share its weights. transformers is imported only by that module.
"""
