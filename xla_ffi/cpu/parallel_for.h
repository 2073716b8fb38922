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
#include <thread>
#include <utility>
#include <vector>

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

// Steps run in order, each a set of tasks: body(step, task) for every task of a step, each step's tasks only
// after every task of the step before has finished (the layers of a chain, each reading the one before). As in
// SharedTasks, every thread takes tasks and waits only for tasks that others are already running (a step's
// tasks all taken, for those still running), so a busy or one-thread pool cannot deadlock it, and a helper
// that starts late joins at the step the others have reached. One hop to the pool serves every step.
class SharedSteps {
 public:
  SharedSteps(const std::vector<int64_t>& tasks, std::function<void(int64_t, int64_t)> body)
      : count_(static_cast<int64_t>(tasks.size())), steps_(new Step[tasks.size()]), body_(std::move(body)) {
    for (int64_t s = 0; s < count_; ++s) steps_[s].tasks = tasks[s];
  }

  // Takes tasks step by step; `last_wait`: waits for the last step's tasks too (the caller, which returns
  // only when every task has finished; a helper leaves as soon as no task is left to take).
  void Drain(bool last_wait) {
    for (int64_t s = 0; s < count_; ++s) {
      Step& step = steps_[s];
      for (int64_t task; (task = step.next.fetch_add(1)) < step.tasks;) {
        if (!failed_.load(std::memory_order_relaxed)) {
          try {
            body_(s, task);
          } catch (const std::exception& e) {
            RecordError(e.what());
          } catch (...) {
            RecordError("unknown error");
          }
        }
        step.finished.fetch_add(1, std::memory_order_release);
      }
      if (s + 1 < count_ || last_wait) WaitFor(step);
    }
  }

  // The first error raised by a task, or an empty string (after a failure the tasks left are skipped).
  std::string Error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  struct Step {
    int64_t tasks = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };

  // Spins, then yields: the tasks waited for are running and short (a few microseconds), but on a machine
  // with fewer cores than threads the one running may have been descheduled.
  static void WaitFor(const Step& step) {
    for (int spins = 0; step.finished.load(std::memory_order_acquire) < step.tasks; ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  void RecordError(const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) error_ = what;
    failed_.store(true, std::memory_order_relaxed);
  }

  const int64_t count_;
  const std::unique_ptr<Step[]> steps_;
  const std::function<void(int64_t, int64_t)> body_;
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::string error_;
};

// Runs every step's tasks in turn (SharedSteps), on the pool's threads too when `parallel`; rethrows the first
// task error.
template <class Body>
void ParallelForSteps(xla::ffi::ThreadPool* pool, const std::vector<int64_t>& tasks, bool parallel, Body&& body) {
  int64_t widest = 0;
  for (int64_t count : tasks) widest = std::max(widest, count);
  if (!parallel || pool == nullptr || widest <= 1) {
    for (int64_t s = 0; s < static_cast<int64_t>(tasks.size()); ++s) {
      for (int64_t task = 0; task < tasks[s]; ++task) body(s, task);
    }
    return;
  }
  auto shared = std::make_shared<SharedSteps>(tasks, std::function<void(int64_t, int64_t)>(std::forward<Body>(body)));
  const int64_t helpers = std::min(PoolThreads(pool) - 1, widest - 1);
  for (int64_t i = 0; i < helpers; ++i) pool->Schedule([shared] { shared->Drain(false); });
  shared->Drain(true);
  std::string error = shared->Error();
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace jaxbnn::cpu

#endif  // JAXBNN_XLA_FFI_CPU_PARALLEL_FOR_H_
