// Part of the native CPU kernels (included inside their anonymous namespaces, never on its own): work items split
// over XLA's intra-op thread pool.

#ifndef PAXKV_CPU_NATIVE_PARALLEL_H_
#define PAXKV_CPU_NATIVE_PARALLEL_H_

// How long the calling thread spins for the other threads' last items before it sleeps. Its sleep and wake-up
// cost more than one item of a decode step's matmul: with a sleep at once, a chain of dependent one-row matmuls on
// two cores ran as slowly as on one (a 576 x 576 bf16 weight at one row, 55 us a call; spinning, 31).
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);

// One spin-wait iteration's hint to the core (another hardware thread, or power, may use it).
inline void SpinPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// Runs fn(item) for item in [0, count) over the pool's threads and this one; returns when every item is done.
// The calling thread works too and waits only for items other threads claimed, never for a task to start (a
// task queued behind busy threads finds nothing left and exits; the state it touches is shared, not on this
// stack), so it cannot deadlock when the pool is busy. It spins up to kSpinBeforeSleep for the items still
// running elsewhere, then sleeps.
struct ParallelState {
  explicit ParallelState(int64_t count) : count(count) {}
  const int64_t count;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_finished;
};

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, F& fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  auto state = std::make_shared<ParallelState>(count);
  auto drain = [state, fn_ptr = &fn] {
    for (int64_t item = state->next.fetch_add(1); item < state->count; item = state->next.fetch_add(1)) {
      (*fn_ptr)(item);
      if (state->finished.fetch_add(1) + 1 == state->count) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->all_finished.notify_all();
      }
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([drain] { drain(); });
  drain();
  const auto spin_start = std::chrono::steady_clock::now();
  while (state->finished.load() != state->count && std::chrono::steady_clock::now() - spin_start < kSpinBeforeSleep) {
    SpinPause();
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_finished.wait(lock, [&] { return state->finished.load() == state->count; });
}

// How many of `count` units of work each item takes so that the items are a multiple of the thread count where the
// units allow, each at most `most` units (SmolLM2's 576 columns as 18 panels of 32: 6 items of 3, not 5 of up to 4,
// which split 3 : 2 over two threads).
inline int64_t EvenItemSize(ffi::ThreadPool& pool, int64_t count, int64_t most) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t fewest_items = (count + most - 1) / most;
  const int64_t even_items = std::max<int64_t>(1, std::min(count, (fewest_items + threads - 1) / threads * threads));
  return (count + even_items - 1) / even_items;
}

#endif  // PAXKV_CPU_NATIVE_PARALLEL_H_
