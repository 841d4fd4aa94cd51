// The neuron device's memory accounting (included by fastpath.cpp; see docs/huggingface.md).
//
// Neuron memory is host memory: a neuron storage is a relabelled CPU storage (fastpath.cpp's `relabel`).
// What `torch.neuron.memory_allocated()` and `torch.accelerator.memory_allocated()` report is the bytes
// of the distinct host buffers that live neuron storages hold:
//   1. `to_neuron` over a buffer no neuron storage holds yet (its "root": a CPU storage that is not
//      itself a relabelling) counts the root's bytes once; more neuron storages over the same root
//      (outputs that alias each other) only add a reference.
//   2. `to_neuron` over a CPU view of neuron memory (`to_cpu` of a neuron tensor) counts nothing: the
//      neuron storage it keeps alive already counts those bytes.
//   3. When the last neuron storage over a root dies, its bytes are subtracted.
// The common case, a kernel's fresh output that nothing else references (`to_neuron_fresh`), needs no
// bookkeeping by root: its one neuron storage counts the bytes and subtracts them when it dies. Only
// buffers that may be shared (aliasing outputs, a CPU tensor the caller keeps) go through the root map.
// The counters sit behind a spin lock: uncontended, it is one atomic exchange and a store, where a
// mutex was two locked instructions and two calls, paid on every op output (benchmarks/dispatch.py).
// The same counters back a c10::DeviceAllocator registered for PrivateUse1, which is what the
// `torch.accelerator` memory functions ask; its own `allocate` (PyTorch's C++ paths that allocate neuron
// storage directly) counts its buffers too. Its `getMemoryInfo` (`torch.accelerator.get_memory_info`)
// answers (capacity - bytes counted, capacity): the capacity is TORCH_NEURONX_DEVICE_MEMORY (set from
// Python, `set_capacity`), by default the host's physical memory. A device index other than 0 is CUDA's
// allocator's error ("Invalid device argument N: did you call init?").

#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/Storage.h>
#include <c10/util/flat_hash_map.h>

#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>

namespace neuron_memory {

// Held for a few instructions, never across a call that could block or enter Python.
struct SpinLock {
  std::atomic_flag f = ATOMIC_FLAG_INIT;
  void lock() {
    while (f.test_and_set(std::memory_order_acquire)) std::this_thread::yield();
  }
  void unlock() { f.clear(std::memory_order_release); }
};

struct Accounting {
  SpinLock mu;
  // root CPU StorageImpl -> (neuron storages over it, bytes counted for it), for buffers that may be
  // shared (`to_neuron`; a fresh output counts itself, `to_neuron_fresh`). Open addressing: an insert
  // allocates nothing.
  ska::flat_hash_map<const c10::StorageImpl*, std::pair<int64_t, int64_t>> roots;
  c10::CachingAllocator::Stat bytes;   // current / peak / allocated / freed, in bytes
  c10::CachingAllocator::Stat buffers; // the same, in buffers

  void add(int64_t n) {
    bytes.increase(static_cast<size_t>(n));
    buffers.increase(1);
  }
  void sub(int64_t n) {
    bytes.decrease(static_cast<size_t>(n));
    buffers.decrease(1);
  }

  // A neuron storage now holds `root` (of `nbytes`).
  void acquire(const c10::StorageImpl* root, int64_t nbytes) {
    std::lock_guard<SpinLock> g(mu);
    auto [it, fresh] = roots.emplace(root, std::pair<int64_t, int64_t>(0, nbytes));
    if (fresh) add(nbytes);
    ++it->second.first;
  }
  // A neuron storage over `root` died.
  void release(const c10::StorageImpl* root) {
    std::lock_guard<SpinLock> g(mu);
    auto it = roots.find(root);
    if (it == roots.end()) return;
    if (--it->second.first == 0) {
      sub(it->second.second);
      roots.erase(it);
    }
  }
  // The counters alone (a buffer only one neuron storage can ever hold, or one the allocator owns).
  void add_locked(int64_t n) {
    std::lock_guard<SpinLock> g(mu);
    add(n);
  }
  void sub_locked(int64_t n) {
    std::lock_guard<SpinLock> g(mu);
    sub(n);
  }
};

// Never destroyed (storages may die during interpreter exit); a namespace-scope pointer, so that the hit
// path reads it without a function-local static's guard.
inline Accounting* const g_accounting = new Accounting();
inline Accounting& accounting() { return *g_accounting; }

// Context of a neuron storage's DataPtr: the source tensor it keeps alive, and what it counts: the root
// in the map (shared buffers), or `own` bytes by itself (a fresh output), or nothing (null root and
// own < 0: its memory is counted by another neuron storage, case 2 above).
struct Holder {
  at::Tensor keep;
  const c10::StorageImpl* root;
  int64_t own;
};

inline void drop_holder(void* ctx) {
  auto* h = static_cast<Holder*>(ctx);
  if (h->root != nullptr) accounting().release(h->root);
  else if (h->own >= 0) accounting().sub_locked(h->own);
  delete h;
}

// Buffers the allocator itself hands out (PyTorch's C++ paths that allocate neuron storage directly).
struct Owned {
  void* ptr;
  int64_t nbytes;
};

inline void drop_owned(void* ctx) {
  auto* o = static_cast<Owned*>(ctx);
  c10::free_cpu(o->ptr);
  accounting().sub_locked(o->nbytes);
  delete o;
}

// The device's capacity in bytes (0: the host's physical memory), or why the setting cannot be used.
struct Capacity {
  SpinLock mu;
  int64_t bytes = 0;
  std::string error;
};
inline Capacity* const g_capacity = new Capacity();

inline void set_capacity(int64_t bytes, std::string error) {
  std::lock_guard<SpinLock> g(g_capacity->mu);
  g_capacity->bytes = bytes;
  g_capacity->error = std::move(error);
}

inline int64_t capacity() {
  int64_t bytes;
  std::string error;
  {
    std::lock_guard<SpinLock> g(g_capacity->mu);
    bytes = g_capacity->bytes;
    error = g_capacity->error;
  }
  TORCH_CHECK(error.empty(), error);
  if (bytes > 0) return bytes;
  return static_cast<int64_t>(sysconf(_SC_PAGE_SIZE)) * static_cast<int64_t>(sysconf(_SC_PHYS_PAGES));
}

// CUDA's allocator's check and message, so code written for CUDA reads the same error.
inline void check_device(c10::DeviceIndex device) {
  TORCH_CHECK(device == 0, "Invalid device argument ", static_cast<int>(device),
              ": did you call init? (this host has one neuron device, neuron:0)");
}

// (free, total): the capacity less the bytes of live neuron storage, and the capacity.
inline std::pair<size_t, size_t> memory_info(c10::DeviceIndex device) {
  check_device(device);
  const int64_t total = capacity();
  int64_t used;
  {
    Accounting& a = accounting();
    std::lock_guard<SpinLock> g(a.mu);
    used = a.bytes.current;
  }
  return {static_cast<size_t>(std::max<int64_t>(0, total - used)), static_cast<size_t>(total)};
}

inline c10::CachingDeviceAllocator::DeviceStats device_stats() {
  Accounting& a = accounting();
  std::lock_guard<SpinLock> g(a.mu);
  c10::CachingDeviceAllocator::DeviceStats s;
  // One pool ("all"); nothing is cached, so reserved = active = allocated = requested.
  constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  s.allocation[all] = a.buffers;
  s.segment[all] = a.buffers;
  s.active[all] = a.buffers;
  s.allocated_bytes[all] = a.bytes;
  s.reserved_bytes[all] = a.bytes;
  s.active_bytes[all] = a.bytes;
  s.requested_bytes[all] = a.bytes;
  return s;
}

inline void reset_peak() {
  Accounting& a = accounting();
  std::lock_guard<SpinLock> g(a.mu);
  a.bytes.reset_peak();
  a.buffers.reset_peak();
}

inline void reset_accumulated() {
  Accounting& a = accounting();
  std::lock_guard<SpinLock> g(a.mu);
  a.bytes.reset_accumulated();
  a.buffers.reset_accumulated();
}

// Host memory the C allocator keeps after frees: given back to the OS. True if any was.
inline bool empty_cache() { return malloc_trim(0) != 0; }

struct NeuronAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n == 0 ? nullptr : c10::alloc_cpu(n);
    auto* o = new Owned{p, static_cast<int64_t>(n)};
    accounting().add_locked(o->nbytes);
    return c10::DataPtr(p, o, &drop_owned, c10::Device(c10::DeviceType::PrivateUse1, 0));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { empty_cache(); }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // ops finish before they return
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    check_device(d);
    return device_stats();
  }
  void resetAccumulatedStats(c10::DeviceIndex d) override {
    check_device(d);
    reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex d) override {
    check_device(d);
    reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override { return memory_info(d); }
};

// PrivateUse1's allocator (registration refuses to run beside another backend before it gets here).
inline void register_allocator() {
  static NeuronAllocator allocator;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &allocator);
}

}  // namespace neuron_memory
