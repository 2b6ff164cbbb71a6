// Fibers for the CUDA emulator (tests/support/cuda_emulator.h): the threads of one emulated
// CTA run as fibers (ucontext) on one OS thread, so that a __syncthreads or a warp-collective
// instruction is a few user-space context switches instead of hundreds of futex wake-ups and
// kernel thread switches (which were two thirds of the emulated tests' time, as system time).
//
// Scheduling is cooperative and deterministic within a CTA: fibers run in index order until
// they block (FiberBarrier), yield (a spin wait: YieldFiber), or return. A round in which every
// runnable fiber only yielded means the CTA waits for something outside it (another CTA, a
// host thread): the OS thread then sleeps briefly, with a backoff. A round with no runnable
// fiber while some have not returned is a deadlock inside the CTA (threads waiting at
// different barriers), which a GPU would hang on; the scheduler reports it to its caller.
//
// Under AddressSanitizer every switch is announced (__sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber), so that ASan knows which stack is live.
#ifndef HSAP_TESTS_SUPPORT_EMULATOR_FIBERS_H_
#define HSAP_TESTS_SUPPORT_EMULATOR_FIBERS_H_

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define HSAP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HSAP_EMU_ASAN 1
#endif
#endif
#ifdef HSAP_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace hsap_emu {

// Fiber stacks, kept for reuse across CTAs and launches. Stacks are mapped, not allocated:
// only the pages a fiber touches are committed. Mapping, first-touching and unmapping a
// launch's hundreds of stacks cost more system time than most emulated kernels run (a
// 512-thread merge kernel spent 4.6 s of 8.5 s in the kernel's memory management), so a
// returned stack keeps its touched pages and its guard page and goes to the next fiber.
// At most kMaxPooled stacks are kept (their touched pages, a few KiB each, stay committed).
class FiberStackPool {
 public:
  // 1 MiB leaves room for the sanitizers' larger frames; the lowest page is a guard.
  static constexpr size_t kStackBytes = size_t{1} << 20;
  static constexpr size_t kGuardBytes = 4096;
  static constexpr size_t kMaxPooled = 4096;

  static void* Take() {
    {
      Pool& pool = Instance();
      std::lock_guard<std::mutex> lock(pool.mu);
      if (!pool.free.empty()) {
        void* stack = pool.free.back();
        pool.free.pop_back();
        return stack;
      }
    }
    void* stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) std::abort();  // test support: out of address space
    mprotect(stack, kGuardBytes, PROT_NONE);
    return stack;
  }

  // `stack` from Take(), whose fiber has finished or will never run again.
  static void Give(void* stack) {
#ifdef HSAP_EMU_ASAN
    // Frames' redzones may still be poisoned; the addresses will be reused.
    __asan_unpoison_memory_region(static_cast<char*>(stack) + kGuardBytes,
                                  kStackBytes - kGuardBytes);
#endif
    {
      Pool& pool = Instance();
      std::lock_guard<std::mutex> lock(pool.mu);
      if (pool.free.size() < kMaxPooled) {
        pool.free.push_back(stack);
        return;
      }
    }
    munmap(stack, kStackBytes);
  }

 private:
  struct Pool {
    std::mutex mu;
    std::vector<void*> free;
  };
  static Pool& Instance() {
    static Pool* pool = new Pool;  // never destroyed: fibers may finish during exit
    return *pool;
  }
};

class FiberScheduler;
inline thread_local FiberScheduler* tl_fibers = nullptr;

// Runs n fibers on the calling thread until each has returned from body(i).
class FiberScheduler {
 public:
  // body(i): fiber i's work; it must not throw. swap(i): called when fiber i starts to run
  // and again when it stops, so that the caller can exchange per-thread state (thread_local
  // variables) with fiber i's saved copy.
  FiberScheduler(int n, std::function<void(int)> body, std::function<void(int)> swap)
      : body_(std::move(body)), swap_(std::move(swap)), fibers_(static_cast<size_t>(n)) {}
  FiberScheduler(const FiberScheduler&) = delete;
  FiberScheduler& operator=(const FiberScheduler&) = delete;
  ~FiberScheduler() {
    for (Fiber& f : fibers_) {
      if (f.stack != nullptr) FiberStackPool::Give(f.stack);
    }
  }

  // Runs every fiber to its end: true, or false on a deadlock (no fiber can run while some
  // have not returned: they wait at barriers that cannot complete). On false, on_deadlock()
  // has been called once (it should stop the launch so that barriers let the fibers out),
  // and every blocked fiber has been woken to find that out and return.
  bool Run(const std::function<void()>& on_deadlock) {
    FiberScheduler* const outer = tl_fibers;
    tl_fibers = this;
    for (size_t i = 0; i < fibers_.size(); ++i) Start(static_cast<int>(i));
    bool deadlocked = false;
    int live = static_cast<int>(fibers_.size());
    auto backoff = std::chrono::microseconds(0);
    while (live > 0) {
      bool any_ran = false, advanced = false;
      for (size_t i = 0; i < fibers_.size(); ++i) {
        Fiber& f = fibers_[i];
        if (f.state != State::kRunnable) continue;
        any_ran = true;
        Resume(static_cast<int>(i));
        if (f.state == State::kDone) --live;
        if (!f.yielded) advanced = true;
      }
      if (!any_ran && live > 0) {
        if (!deadlocked) on_deadlock();
        deadlocked = true;
        for (Fiber& f : fibers_) {
          if (f.state == State::kBlocked) f.state = State::kRunnable;
        }
        continue;
      }
      if (advanced) {
        backoff = std::chrono::microseconds(0);
      } else if (backoff.count() == 0) {
        backoff = std::chrono::microseconds(1);
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::microseconds(200));
      }
    }
    tl_fibers = outer;
    return !deadlocked;
  }

  // ---- from inside a fiber of this scheduler ----
  int current() const { return current_; }
  // Stops the calling fiber until Wake(current()).
  void Block() {
    fibers_[static_cast<size_t>(current_)].state = State::kBlocked;
    SwitchToScheduler(/*finished=*/false);
  }
  void Wake(int i) {
    Fiber& f = fibers_[static_cast<size_t>(i)];
    if (f.state == State::kBlocked) f.state = State::kRunnable;
  }
  // Lets the other fibers run (the caller waits for something they or others will do).
  void Yield() {
    fibers_[static_cast<size_t>(current_)].yielded = true;
    SwitchToScheduler(/*finished=*/false);
  }

 private:
  static constexpr size_t kStackBytes = FiberStackPool::kStackBytes;
  enum class State { kRunnable, kBlocked, kDone };
  struct Fiber {
    ucontext_t context{};
    void* stack = nullptr;
    State state = State::kRunnable;
    bool yielded = false;  // its last run ended in Yield()
  };

  void Start(int i) {
    Fiber& f = fibers_[static_cast<size_t>(i)];
    f.stack = FiberStackPool::Take();
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, &FiberScheduler::Entry, 0);
    // makecontext has put the stack into the saved registers; the switches never read
    // uc_stack again. ASan's swapcontext interceptor does: it clears the shadow of the target's
    // whole uc_stack on every switch (a 128 KiB madvise per switch, and the live frames'
    // redzones lost). The switch annotations above tell ASan the stacks instead.
    f.context.uc_stack.ss_sp = nullptr;
    f.context.uc_stack.ss_size = 0;
  }

  static void Entry() {
    FiberScheduler* self = tl_fibers;
#ifdef HSAP_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &self->scheduler_stack_, &self->scheduler_stack_size_);
#endif
    const int i = self->current_;
    self->body_(i);
    self->fibers_[static_cast<size_t>(i)].state = State::kDone;
    self->SwitchToScheduler(/*finished=*/true);
  }

  void Resume(int i) {
    Fiber& f = fibers_[static_cast<size_t>(i)];
    f.yielded = false;
    current_ = i;
    swap_(i);
#ifdef HSAP_EMU_ASAN
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, f.stack, kStackBytes);
#endif
    swapcontext(&scheduler_, &f.context);
#ifdef HSAP_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    swap_(i);
    current_ = -1;
  }

  void SwitchToScheduler(bool finished) {
    Fiber& f = fibers_[static_cast<size_t>(current_)];
#ifdef HSAP_EMU_ASAN
    void* fake_stack = nullptr;
    // A finished fiber's fake stack is released (nullptr), as it never runs again.
    __sanitizer_start_switch_fiber(finished ? nullptr : &fake_stack, scheduler_stack_,
                                   scheduler_stack_size_);
#else
    (void)finished;
#endif
    swapcontext(&f.context, &scheduler_);
#ifdef HSAP_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake_stack, &scheduler_stack_, &scheduler_stack_size_);
#endif
  }

  std::function<void(int)> body_, swap_;
  std::vector<Fiber> fibers_;
  ucontext_t scheduler_{};
  int current_ = -1;
#ifdef HSAP_EMU_ASAN
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_size_ = 0;
#endif
};

}  // namespace hsap_emu

#endif  // HSAP_TESTS_SUPPORT_EMULATOR_FIBERS_H_
