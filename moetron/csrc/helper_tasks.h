// Shared by the grouped GEMM and the causal attention: the tasks of one op run by the calling thread and
// helper tasks on torch's inter-op pool (a small model trains on one intra-op thread and gives its widest
// ops a helper: moetron/kernels/threads.py). Each thread takes the next task index from one counter, so a
// thread that another process keeps off its core simply takes fewer; the caller waits only for tasks a
// helper has started, where an OpenMP region waits at its closing barrier for every thread to arrive.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <thread>

// MKL's thread count is per thread: torch sets the calling thread's, but an inter-op pool thread keeps the
// count it started with (the machine's cores), so a helper's BLAS call could split its piece over an OpenMP
// team: the rows' bits then depend on the split, and the team oversubscribes the cores. MKL's C entry point
// (mkl_service.h maps mkl_set_num_threads_local to it; the lower-case symbol is the Fortran one, by
// reference). Weak: torch builds without MKL have no such call (and no such problem).
extern "C" __attribute__((weak)) int MKL_Set_Num_Threads_Local(int);

namespace moetron {
namespace {

// One BLAS thread on this thread while it lives (the previous setting back after).
struct SequentialBlas {
  int previous = 0;
  SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  }
};

// fn(i) for every i in [0, n), on the calling thread and `helpers` inter-op tasks; the first exception
// stops new tasks and is rethrown here. fn may refer to the caller's data: it runs only while the caller
// waits (a helper that starts after the work ran out calls nothing).
inline void run_with_helpers(int64_t n, int64_t helpers, const std::function<void(int64_t)>& fn) {
  struct Shared {
    std::function<void(int64_t)> fn;
    int64_t n;
    std::atomic<int64_t> next{0}, busy{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  shared->fn = fn;
  shared->n = n;
  auto take = [](Shared& s) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // ops called inside stay below autograd
    try {
      for (int64_t i = s.next.fetch_add(1); i < s.n; i = s.next.fetch_add(1)) s.fn(i);
    } catch (...) {
      s.next.store(s.n);  // nobody starts another task
      if (!s.failed.exchange(true)) s.error = std::current_exception();
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    at::launch([shared, take] {
      shared->busy.fetch_add(1);  // before taking a task: the caller then waits for it
      SequentialBlas sequential;  // as the caller's own pieces run
      take(*shared);
      shared->busy.fetch_sub(1);
    });
  }
  take(*shared);
  while (shared->busy.load() != 0) std::this_thread::yield();
  if (shared->failed.load()) std::rethrow_exception(shared->error);
}

// Who runs an op's tasks: torch's intra-op threads (helpers == 0), or the calling thread and `helpers`
// inter-op tasks; never more threads than tasks.
inline int64_t threads_for(int64_t helpers, int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>(helpers > 0 ? helpers + 1 : at::get_num_threads(), work));
}

// fn(i) for every i in [0, n), each index taken by the next free thread from one counter: with helpers
// the caller and its helper tasks (above), else torch's intra-op threads, so that there too a thread
// that another process keeps off its core takes fewer tasks instead of holding up a static share.
inline void run_tasks(int64_t n, int64_t helpers, const std::function<void(int64_t)>& fn) {
  const int64_t P = threads_for(helpers, n);
  if (helpers > 0 && P > 1) return run_with_helpers(n, P - 1, fn);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, P, 1, [&](int64_t, int64_t) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the pool's threads have their own grad mode
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

}  // namespace
}  // namespace moetron
