// Work split over XLA's intra-op thread pool, shared by the CPU kernels.
#ifndef JAXBNN_XLA_FFI_CPU_PARALLEL_FOR_H_
#define JAXBNN_XLA_FFI_CPU_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxbnn::cpu {

// Runs body(task) for every task in [0, tasks) on the calling thread and XLA's intra-op thread pool. The
// caller takes tasks too and only waits for tasks that are already running, so a busy or one-thread pool
// cannot deadlock it; helpers that start late find no task left and return at once (they only touch the
// shared state, which they keep alive).
class SharedTasks {
 public:
  SharedTasks(int64_t tasks, std::function<void(int64_t)> body) : tasks_(tasks), body_(std::move(body)) {}

  void Drain() {
    for (int64_t task; (task = next_.fetch_add(1)) < tasks_;) {
      try {
        body_(task);
      } catch (const std::exception& e) {
        RecordError(e.what());
      } catch (...) {
        RecordError("unknown error");
      }
      if (finished_.fetch_add(1) + 1 == tasks_) {
        std::lock_guard<std::mutex> lock(mutex_);
        all_finished_.notify_all();
      }
    }
  }

  // Returns the first error raised by a task, or an empty string. The tasks left to others are short (a few
  // to a few hundred microseconds), so the caller first polls for a while: blocked, it would resume only
  // when the scheduler gets to it after the last helper's notify.
  std::string WaitAll() {
    const auto deadline = std::chrono::steady_clock::now() + kPollFor;
    while (finished_.load() < tasks_ && std::chrono::steady_clock::now() < deadline) {
      for (int i = 0; i < 64 && finished_.load(std::memory_order_relaxed) < tasks_; ++i) Pause();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    all_finished_.wait(lock, [this] { return finished_.load() >= tasks_; });
    return error_;
  }

 private:
  void RecordError(const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = what;
  }

  static constexpr std::chrono::microseconds kPollFor{50};

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  const int64_t tasks_;
  const std::function<void(int64_t)> body_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> finished_{0};
  std::mutex mutex_;
  std::condition_variable all_finished_;
  std::string error_;
};

inline int64_t PoolThreads(xla::ffi::ThreadPool* pool) {
  return pool == nullptr ? 1 : std::max<int64_t>(1, pool->num_threads());
}

// Runs every task, on the pool's threads too when `parallel`; rethrows the first task error. Without threads
// the tasks run in a plain loop: no shared state or type-erased body to allocate, which costs a call of a
// few microseconds (a layer at batch 1) a measurable share.
template <class Body>
void ParallelFor(xla::ffi::ThreadPool* pool, int64_t tasks, bool parallel, Body&& body) {
  if (!parallel || pool == nullptr || tasks <= 1) {
    for (int64_t task = 0; task < tasks; ++task) body(task);
    return;
  }
  auto shared = std::make_shared<SharedTasks>(tasks, std::function<void(int64_t)>(std::forward<Body>(body)));
  // The calling thread is one of the workers.
  const int64_t helpers = std::min(PoolThreads(pool) - 1, tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool->Schedule([shared] { shared->Drain(); });
  shared->Drain();
  std::string error = shared->WaitAll();
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_PARALLEL_FOR_H_
