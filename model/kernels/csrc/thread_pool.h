// A small thread pool for the kernels: the calling thread and (threads - 1) workers claim tasks
// 0..n-1 of one job from a shared counter. Which thread runs a task never changes its result: every
// kernel gives each task its own outputs and reduces nothing across tasks.
//
// Workers spin for a short while after a job (the next kernel call of a step follows within
// microseconds), then sleep on a futex (std::atomic::wait). A caller that finds the pool busy with
// another thread's job runs its own job alone instead of waiting.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace kv {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  int num_threads() const { return int(workers_.size()) + 1; }

  void set_num_threads(int n) {
    std::lock_guard<std::mutex> guard(job_mutex_);
    stop_workers();
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  void set_spin_us(int64_t microseconds) { spin_us_.store(microseconds); }
  int64_t spin_us() const { return spin_us_.load(); }

  static constexpr int64_t kMaxTasks = (int64_t(1) << 20) - 1;

  // Runs fn(task) for task in [0, n) across the pool; returns when all are done. n <= kMaxTasks.
  template <typename Fn>
  void run(int64_t n, Fn&& fn) {
    if (n <= 0) return;
    std::unique_lock<std::mutex> guard(job_mutex_, std::try_to_lock);
    // the lock first: set_num_threads (another thread) replaces workers_ while it holds it
    if (!guard.owns_lock() || n == 1 || workers_.empty() || n > kMaxTasks) {
      for (int64_t t = 0; t < n; ++t) fn(t);
      return;
    }
    using F = std::remove_reference_t<Fn>;
    job_fn_ = [](void* ctx, int64_t t) { (*static_cast<F*>(ctx))(t); };
    job_ctx_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = ((state_.load(std::memory_order_relaxed) >> 40) + 1) & 0xffffff;
    state_.store(generation << 40 | uint64_t(n) << 20, std::memory_order_release);  // publishes the job
    wake_.fetch_add(1, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    work(generation);
    // The last tasks may be on a worker the OS has descheduled (other processes share the cores):
    // after a short spin, yield the core so that it can finish.
    for (int64_t i = 0; done_.load(std::memory_order_acquire) < n; ++i) {
      if (i < 4096)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  ThreadPool() = default;
  ~ThreadPool() { stop_workers(); }

  // Claims and runs tasks of job `generation` until none are left (or a newer job replaced it). The
  // task count travels in the same word as the generation and the counter, so a claim can never
  // pair one job's counter with another job's size; a claim that succeeds proves its job unfinished,
  // so its function and context are still in place.
  void work(uint64_t generation) {
    uint64_t state = state_.load(std::memory_order_acquire);
    while ((state >> 40) == generation) {
      const int64_t task = int64_t(state & 0xfffff), tasks = int64_t((state >> 20) & 0xfffff);
      if (task >= tasks) return;
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        job_fn_(job_ctx_, task);
        done_.fetch_add(1, std::memory_order_release);
        state = state_.load(std::memory_order_acquire);
      }
    }
  }

  void worker_loop() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 40;
    while (true) {
      const uint32_t wake = wake_.load(std::memory_order_acquire);
      uint64_t generation = state_.load(std::memory_order_acquire) >> 40;
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_.load());
      for (int64_t i = 1; generation == seen; ++i) {
        _mm_pause();
        generation = state_.load(std::memory_order_acquire) >> 40;
        if (i % 64 == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      if (stopping_.load(std::memory_order_acquire)) return;
      if (generation == seen) {
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        if ((state_.load(std::memory_order_acquire) >> 40) == seen && !stopping_.load()) wake_.wait(wake);
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        continue;
      }
      seen = generation;
      work(generation);
    }
  }

  void stop_workers() {
    stopping_.store(true, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    stopping_.store(false, std::memory_order_release);
  }

  std::mutex job_mutex_;  // one job at a time; held by the caller for the whole job
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};  // job generation (24 bits) | its task count (20) | next unclaimed task (20)
  std::atomic<int64_t> done_{0};    // tasks of the current job that have finished
  std::atomic<uint32_t> wake_{0};   // bumped on every new job: what sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> spin_us_{100};  // how long an idle worker spins before it sleeps
  void (*job_fn_)(void*, int64_t) = nullptr;
  void* job_ctx_ = nullptr;
};

}  // namespace kv
