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
// The same counters back a c10::DeviceAllocator registered for PrivateUse1, which is what the
// `torch.accelerator` memory functions ask; its own `allocate` (PyTorch's C++ paths that allocate neuron
// storage directly) counts its buffers too.

#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/Storage.h>
#include <c10/util/flat_hash_map.h>

#include <malloc.h>

#include <mutex>

namespace neuron_memory {

struct Accounting {
  std::mutex mu;
  // root CPU StorageImpl -> (neuron storages over it, bytes counted for it). Open addressing: an
  // insert allocates nothing (this runs for every op output).
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
    std::lock_guard<std::mutex> g(mu);
    auto [it, fresh] = roots.emplace(root, std::pair<int64_t, int64_t>(0, nbytes));
    if (fresh) add(nbytes);
    ++it->second.first;
  }
  // A neuron storage over `root` died.
  void release(const c10::StorageImpl* root) {
    std::lock_guard<std::mutex> g(mu);
    auto it = roots.find(root);
    if (it == roots.end()) return;
    if (--it->second.first == 0) {
      sub(it->second.second);
      roots.erase(it);
    }
  }
};

inline Accounting& accounting() {
  static Accounting* a = new Accounting();  // never destroyed: storages may die during interpreter exit
  return *a;
}

// Context of a neuron storage's DataPtr: the source tensor it keeps alive and the root it counts (null
// when its memory is counted by another neuron storage, case 2 above).
struct Holder {
  at::Tensor keep;
  const c10::StorageImpl* root;
};

inline void drop_holder(void* ctx) {
  auto* h = static_cast<Holder*>(ctx);
  if (h->root != nullptr) accounting().release(h->root);
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
  {
    std::lock_guard<std::mutex> g(accounting().mu);
    accounting().sub(o->nbytes);
  }
  delete o;
}

inline c10::CachingDeviceAllocator::DeviceStats device_stats() {
  Accounting& a = accounting();
  std::lock_guard<std::mutex> g(a.mu);
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
  std::lock_guard<std::mutex> g(a.mu);
  a.bytes.reset_peak();
  a.buffers.reset_peak();
}

inline void reset_accumulated() {
  Accounting& a = accounting();
  std::lock_guard<std::mutex> g(a.mu);
  a.bytes.reset_accumulated();
  a.buffers.reset_accumulated();
}

// Host memory the C allocator keeps after frees: given back to the OS. True if any was.
inline bool empty_cache() { return malloc_trim(0) != 0; }

struct NeuronAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n == 0 ? nullptr : c10::alloc_cpu(n);
    auto* o = new Owned{p, static_cast<int64_t>(n)};
    {
      std::lock_guard<std::mutex> g(accounting().mu);
      accounting().add(o->nbytes);
    }
    return c10::DataPtr(p, o, &drop_owned, c10::Device(c10::DeviceType::PrivateUse1, 0));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { empty_cache(); }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // ops finish before they return
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override { return device_stats(); }
  void resetAccumulatedStats(c10::DeviceIndex) override { reset_accumulated(); }
  void resetPeakStats(c10::DeviceIndex) override { reset_peak(); }
};

// PrivateUse1's allocator (registration refuses to run beside another backend before it gets here).
inline void register_allocator() {
  static NeuronAllocator allocator;
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &allocator);
}

}  // namespace neuron_memory
