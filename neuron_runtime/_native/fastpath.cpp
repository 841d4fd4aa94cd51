// The native hit path of neuron-runtime (see neuron_runtime/_native/__init__.py and docs/dispatch.md).
//
// Everything here is an accelerator for what the Python kernels of `aten/` (`_codegen.py`, `_runtime.py`)
// already do; every case this file does not handle goes to them unchanged:
//   * relabelling host memory between the `cpu` and `neuron` devices (no DLPack round trip);
//   * view ops: the CPU kernel runs on the neuron tensor itself (metadata only);
//   * compute and in-place ops: the key of a call is built from the dispatcher's stack, looked up in a
//     per-op table the Python slow path fills, and the executable runs without entering Python for the
//     `reference` tier (it is the aten op on host memory) or with one Python call for any other tier.
// A key this file does not build (conjugate bits, CPU tensors, list arguments, ...), a miss, and any
// exception on the hit path all call the Python kernel, which decides everything as before.

#include <torch/extension.h>

#include <ATen/DynamicLibrary.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Storage.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/profiler/api.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include "memory.h"
#include "trace.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

namespace py = pybind11;
using Stack = torch::jit::Stack;

// ---------------------------------------------------------------------------------------------------
// Relabelling: a tensor of the other device over the same storage. The new storage's context holds a
// reference to the source: a neuron tensor made of a CPU tensor holds that tensor (the CPU tensor's use
// count says whether anything still reads it: fusion relies on that), a CPU view of a neuron tensor holds
// the neuron tensor's storage, not the tensor, so `x.data = y` on the neuron tensor cannot free memory a
// view still reads (a queued op's input).
// ---------------------------------------------------------------------------------------------------
// The context is the source storage itself, holding one reference taken by `hold_source` (no allocation
// of its own: ~67 CPU views a decode token are made and dropped).
void drop_source(void* ctx) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx)); }
inline void* hold_source(const c10::Storage& s) {
  c10::StorageImpl* impl = s.unsafeGetStorageImpl();
  c10::raw::intrusive_ptr::incref(impl);
  return impl;
}

// mutable_data(): a copy-on-write storage gets its own memory first, as a DLPack export does. `ctx` and
// `del` make the new storage's DataPtr context: what keeps the source alive, and how it is let go.
inline at::Tensor relabel(const at::Tensor& t, const c10::Storage& src, c10::DispatchKey key, c10::Device dev,
                          void* ctx, c10::DeleterFnPtr del) {
  c10::Storage st(c10::Storage::use_byte_size_t(), src.nbytes(),
                  c10::DataPtr(const_cast<c10::Storage&>(src).mutable_data(), ctx, del, dev), nullptr, false);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(key), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  // The lazy conjugate and negative bits are part of what the values are (a CPU kernel may return a
  // conjugated view, e.g. linalg_lu_solve with adjoint=True, left=False): keep them.
  if (C10_UNLIKELY(t.is_conj() || t.is_neg())) {
    out._set_conj(t.is_conj());
    out._set_neg(t.is_neg());
  }
  return out;
}

const c10::Device kNeuron(c10::DeviceType::PrivateUse1, 0);
const c10::Device kCpu(c10::DeviceType::CPU);

// A neuron tensor's storage counts its host buffer in the device's memory accounting (memory.h) unless
// the buffer is a CPU view of neuron memory, which another neuron storage counts already.
inline bool counted_elsewhere(const c10::Storage& src) {
  const c10::DeleterFnPtr d = src.data_ptr().get_deleter();
  return d == &drop_source || d == &neuron_memory::drop_holder || d == &neuron_memory::drop_owned;
}

at::Tensor to_neuron(const at::Tensor& t) {
  const c10::Storage& src = t.storage();
  const c10::StorageImpl* root = counted_elsewhere(src) ? nullptr : src.unsafeGetStorageImpl();
  auto* h = new neuron_memory::Holder{t, root, -1};
  if (root != nullptr) neuron_memory::accounting().acquire(root, static_cast<int64_t>(src.nbytes()));
  return relabel(t, src, c10::DispatchKey::PrivateUse1, kNeuron, h, &neuron_memory::drop_holder);
}

// A kernel's output handed over for good (the caller keeps no reference). When nothing else holds the
// tensor or its storage, the new neuron storage becomes the only way to reach the buffer, so it counts
// the bytes itself, with no entry in the root map (memory.h).
at::Tensor to_neuron_fresh(at::Tensor&& t) {
  const c10::Storage& src = t.storage();
  if (t.use_count() != 1 || src.use_count() != 1 || counted_elsewhere(src)) return to_neuron(t);
  const auto nbytes = static_cast<int64_t>(src.nbytes());
  auto* h = new neuron_memory::Holder{std::move(t), nullptr, nbytes};
  neuron_memory::accounting().add_locked(nbytes);
  return relabel(h->keep, h->keep.storage(), c10::DispatchKey::PrivateUse1, kNeuron, h, &neuron_memory::drop_holder);
}

at::Tensor to_cpu(const at::Tensor& t) {
  return relabel(t, t.storage(), c10::DispatchKey::CPU, kCpu, hold_source(t.storage()), &drop_source);
}

// The CPU view the native path hands a kernel for a neuron tensor, kept in the tensor's BackendMeta slot:
// made once per tensor rather than once per op that reads it (a parameter is read by every step). A
// `CpuView` never changes once made; it serves only while the tensor still has the storage, memory,
// sizes, strides, offset, dtype and conj/neg bits it was made for (`fits`), else a new one replaces it.
// A detached or shallow copy of the tensor shares it (BackendMeta::clone's default) under the same
// check. It holds the view, the view holds the storage: no cycle back to the tensor, and `x.data = y`
// drops it with the old memory (TensorImpl's metadata copy replaces or clears the slot). One lock for
// all slots: two threads may read one tensor (autograd's engine and the main thread).
struct CpuView final : c10::BackendMeta {
  CpuView(at::Tensor v, const c10::StorageImpl* s) : view(std::move(v)), of(s), ctx(s->data_ptr().get_context()) {}
  at::Tensor view;
  const c10::StorageImpl* of;  // the neuron storage it views (alive while the view is)
  const void* ctx;             // that storage's DataPtr context then: a swapped DataPtr (resize, a
                               // copy-on-write clone) makes the view stale
};
// A spin lock (memory.h): held for a lookup and a compare, and taken twice or more per op, where a mutex
// cost ~150 instructions a pair more (callgrind, benchmarks/dispatch.py's add).
neuron_memory::SpinLock g_view_mu;

// Whether CPU tensor `v` reads neuron storage `s` as `t` does.
inline bool reads_as(const at::Tensor& v, const c10::StorageImpl* s, const at::Tensor& t) {
  return v.storage().data() == s->data() && v.storage().nbytes() == s->nbytes() && v.dtype() == t.dtype() &&
         v.storage_offset() == t.storage_offset() && v.sizes() == t.sizes() && v.strides() == t.strides() &&
         v.is_conj() == t.is_conj() && v.is_neg() == t.is_neg();
}

inline bool fits(const CpuView& c, const at::Tensor& t) {
  const c10::StorageImpl* s = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return c.of == s && c.ctx == s->data_ptr().get_context() && reads_as(c.view, s, t);
}

// A kernel's fresh output (to_neuron_fresh) still read as it was made: the CPU tensor its storage holds is
// its view already (no lock, no new view: most intermediates are read once or twice); else null.
inline const at::Tensor* fresh_view(const at::Tensor& t) {
  const c10::StorageImpl* s = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (s == nullptr || s->data_ptr().get_deleter() != &neuron_memory::drop_holder) return nullptr;
  const auto* h = static_cast<const neuron_memory::Holder*>(s->data_ptr().get_context());
  return h->own >= 0 && reads_as(h->keep, s, t) ? &h->keep : nullptr;
}

at::Tensor cpu_view(const at::Tensor& t) {
  if (const at::Tensor* v = fresh_view(t)) return *v;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  std::lock_guard<neuron_memory::SpinLock> lock(g_view_mu);
  if (auto* c = dynamic_cast<CpuView*>(impl->get_backend_meta()); c != nullptr && fits(*c, t)) return c->view;
  at::Tensor v = to_cpu(t);
  // A view (`w.t()`, a slice) is most often made, read once and dropped: keeping its CPU view in the slot
  // would cost an allocation and a destructor for nothing (~67 views a decode token).
  if (!t.is_view()) impl->set_backend_meta(c10::make_intrusive<CpuView>(v, impl->unsafe_storage().unsafeGetStorageImpl()));
  return v;
}

const c10::DispatchKeySet kCpuKeys(c10::DispatchKey::CPU);

// ---------------------------------------------------------------------------------------------------
// The device guard: one device, index 0, one default stream, ops that finish before they return (so
// events and synchronisation have nothing to wait for). PyTorch's Python-backed guard behaves the same
// but calls into Python for every method (hundreds of times per training step: autograd guards every
// node); this one never does.
// ---------------------------------------------------------------------------------------------------
struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device) const override { return kNeuron; }
  c10::Device getDevice() const override { return kNeuron; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  static c10::Stream stream() { return c10::Stream(c10::Stream::DEFAULT, kNeuron); }
};

bool register_device_guard() {
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) return false;
  static NeuronGuard guard;
  c10::impl::registerDeviceGuard(c10::DeviceType::PrivateUse1, &guard);
  return true;
}

// The device's hooks. What the Python hooks cannot do: hand out a "pinned" host allocator, and resize a
// storage in place, which FSDP2 does to
// free an unsharded parameter (`untyped_storage().resize_(0)`) and to allocate it again before the next
// all-gather. The storage gets a new host buffer (the old bytes copied up to the smaller size).
// "Pinned" host buffers: plain CPU memory, remembered so that `is_pinned()` holds for them (DDP's reducer
// asserts it of the staging buffer it asked for).
std::mutex g_pinned_mu;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    g_pinned.erase(p);
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned.insert(p);
    }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

struct NeuronHooks : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  // Host memory needs no pinning: a "pinned" staging buffer (DDP's unused-parameter map) is plain CPU memory.
  c10::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedAllocator pinned;
    return &pinned;
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    return g_pinned.count(data) > 0;
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    c10::DataPtr dp = c10::GetCPUAllocator()->allocate(newsize);
    const size_t keep = std::min(impl->nbytes(), newsize);
    if (keep > 0 && impl->data() != nullptr) std::memcpy(dp.get(), impl->data(), keep);
    dp.unsafe_set_device(kNeuron);
    impl->set_data_ptr_noswap(std::move(dp));
    impl->set_nbytes(newsize);
  }
};

// scaled_dot_product_attention picks its kernel by device: a device without a choice gets the math
// composite (~10 ops). Neuron makes CPU's choice (CPU's flash kernel where it applies, else the math
// composite), so attention computes as on CPU, bit for bit on the reference tier, in one op
// (`_scaled_dot_product_flash_attention_for_cpu`, a library call on the aoti tier) rather than ten.
// CPU's choice reads only sizes, strides, dtypes and whether an input requires grad (flash attention has
// no gradient for a mask: a mask that requires grad gets the math composite): it is asked about CPU
// tensors with this metadata over a buffer nobody reads (the tensors may have no data: torch.compile
// traces with fake tensors).
at::Tensor cpu_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return t;
  alignas(64) static char unread[64];
  at::Tensor alias = at::from_blob(unread, t.sizes(), t.strides(),
                                   t.options().device(c10::kCPU).requires_grad(false));
  if (t.requires_grad()) alias.set_requires_grad(true);
  return alias;
}

int64_t neuron_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout, bool causal,
                          std::optional<double> scale, bool gqa) {
  std::optional<at::Tensor> m;
  if (mask.has_value()) m = cpu_alias(*mask);
  // Straight to CPU's kernel: no mode above it (torch.compile's fake tensors) sees these stand-ins.
  return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), cpu_alias(q),
                                                 cpu_alias(k), cpu_alias(v), m, dropout, causal, scale, gqa);
}

bool register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) return false;
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}

// ---------------------------------------------------------------------------------------------------
// Registration (one torch::Library fragment, alive for the process).
// ---------------------------------------------------------------------------------------------------
struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}  // "overriding a previously registered kernel": intended
};

torch::Library& library() {
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                        __FILE__, __LINE__);
  return *lib;
}

// Fusion (TORCH_NEURONX_ENABLE_CONCATENATION=1) queues pointwise ops in Python; every other op must
// run them first. `g_pending` mirrors "the queue is not empty"; `g_flush(reason)` runs it.
std::atomic<bool> g_pending{false};
PyObject* g_flush = nullptr;

void flush_queued(const char* reason) {
  py::gil_scoped_acquire gil;
  if (g_flush == nullptr) return;
  py::object r = py::reinterpret_steal<py::object>(PyObject_CallFunction(g_flush, "s", reason));
  if (!r) throw python_error();
}

void flush_queued(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  std::string reason = "op:" + name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
  flush_queued(reason.c_str());
}

// Whether fusion must run its queue before a view of `v`: a view is metadata, so only while ops queued
// in Python are pending (their memory is not tracked here) or when `v` views memory a queued op writes.
bool view_needs_flush(const c10::IValue& v);

void view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, Stack* stack) {
  if (g_pending.load(std::memory_order_relaxed)) {
    const size_t n = op.schema().arguments().size();
    if (n == 0 || view_needs_flush((*stack)[stack->size() - n])) flush_queued(op);
  }
  op.redispatchBoxed(kCpuKeys, stack);
}

std::string op_name(const std::string& qualname) {  // "aten::add.Tensor" -> "add.Tensor"
  auto pos = qualname.find("::");
  return pos == std::string::npos ? qualname : qualname.substr(pos + 2);
}

// The views every program makes (`t`, `transpose`, `expand`, slicing and `reshape` end in these) as
// typed kernels calling what their CPU kernels call: no boxing of the arguments, no redispatch (~1 us
// of a ~3 us `t()`).
void flush_before_view(const at::Tensor& self, const char* reason) {
  if (g_pending.load(std::memory_order_relaxed) && view_needs_flush(c10::IValue(self))) flush_queued(reason);
}

at::Tensor as_strided_kernel(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                             std::optional<c10::SymInt> offset) {
  flush_before_view(self, "op:aten::as_strided");
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           offset ? std::optional<int64_t>(offset->expect_int()) : std::nullopt);
}

at::Tensor view_kernel_typed(const at::Tensor& self, c10::SymIntArrayRef size) {
  flush_before_view(self, "op:aten::view");
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias_kernel(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  flush_before_view(self, "op:aten::_reshape_alias");
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

void register_view(const std::string& qualname) {
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  if (qualname == "aten::as_strided") {
    library().impl("as_strided", TORCH_FN(as_strided_kernel));
  } else if (qualname == "aten::view") {
    library().impl("view", TORCH_FN(view_kernel_typed));
  } else if (qualname == "aten::_reshape_alias") {
    library().impl("_reshape_alias", TORCH_FN(reshape_alias_kernel));
  } else {
    library().impl(op_name(qualname).c_str(), torch::CppFunction::makeFromBoxedFunction<&view_kernel>());
  }
}

// ---------------------------------------------------------------------------------------------------
// Compute and in-place ops.
// ---------------------------------------------------------------------------------------------------
// OUT: an out= op's `out` tensor: no key words (the functional executable's key is the other arguments'),
// never an input of the executable; the result is copied into it when its dtype and sizes fit.
// OPT_TENSORS: a `Tensor?[]` (`index.Tensor`'s indices), functional ops only: its tensors are inputs in order,
// its Nones left out (signatures' `tensors_in`), each position keyed as a tensor or None.
enum Kind : int { TENSOR = 0, OPT_TENSOR = 1, SCALAR = 2, VALUE = 3, TENSORS = 4, SCALARS = 5, OUT = 6,
                  OPT_TENSORS = 7 };

using Key = std::vector<int64_t>;

// An element of a `Tensor?[]` that holds a tensor (None and an undefined tensor are both absent).
inline bool present(const c10::IValue& x) { return x.isTensor() && x.toTensor().defined(); }

// Key words: a tag per argument, then its content. Tags keep e.g. int 1, float 1.0 and True apart.
enum Tag : int64_t {
  T_NONE = -1, T_TENSOR = -2, T_WRAPPED = -3, T_INT = -4, T_DOUBLE = -5, T_BOOL = -6, T_COMPLEX = -7,
  T_INTLIST = -8, T_STRING = -9, T_DEVICE = -10, T_DOUBLELIST = -11, T_BOOLLIST = -12, T_LIST = -13,
};

// Whether a 4-D or 5-D layout reads as channels_last to `suggest_memory_format` (c10's own test).
inline bool channels_last_guess(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  return sizes.size() == 4 ? c10::is_channels_last_strides_2d(sizes, strides)
                           : c10::is_channels_last_strides_3d(sizes, strides);
}

// The strides of a tensor with a size-0 or size-1 dim as its signature keys them (signatures/_signature.py,
// `canonical_strides`, step for step): strides no element is addressed through become the values a fresh
// tensor has, except where that would change eager's channels_last guess. So a slice `ids[:, -1:]` of a
// buffer that grows by a column per token keys the same native entry at every position.
void canonical_stride_words(c10::IntArrayRef sizes, c10::IntArrayRef strides, Key& key) {
  const size_t n = sizes.size();
  c10::SmallVector<int64_t, 6> out(strides.begin(), strides.end());
  bool empty = false;
  for (int64_t v : sizes) empty = empty || v == 0;
  if (empty) {  // 1. an empty tensor addresses nothing: contiguous strides
    int64_t expected = 1;
    for (size_t i = n; i-- > 0;) {
      out[i] = expected;
      expected *= std::max<int64_t>(sizes[i], 1);
    }
  } else {  // 2. a size-1 dim: the contiguous value over the dims inside it
    for (size_t i = n; i-- > 0;) {
      if (sizes[i] == 1) out[i] = i + 1 < n ? out[i + 1] * sizes[i + 1] : 1;
    }
    // 3. a 4-D or 5-D tensor keeps eager's channels_last guess
    if ((n == 4 || n == 5) && !std::equal(out.begin(), out.end(), strides.begin())) {
      const bool guess = channels_last_guess(sizes, strides);
      if (channels_last_guess(sizes, out) != guess) {
        static const int order4[] = {1, 3, 2, 0};
        static const int order5[] = {1, 4, 3, 2, 0};
        const int* order = n == 4 ? order4 : order5;
        c10::SmallVector<int64_t, 6> last(strides.begin(), strides.end());
        int64_t inner = 1;
        for (size_t j = 0; j < n; ++j) {
          const int d = order[j];
          if (sizes[d] == 1) last[d] = inner;
          else inner = strides[d] * sizes[d];
        }
        if (channels_last_guess(sizes, last) == guess) out = last;
        else out.assign(strides.begin(), strides.end());
      }
    }
  }
  for (int64_t v : out) key.push_back(v);
}

// The key words of a neuron tensor; false for anything else (the Python kernel decides those).
inline bool tensor_words(const at::Tensor& t, Key& key) {
  if (!t.defined()) return false;
  auto* impl = t.unsafeGetTensorImpl();
  if (impl->device_type() != c10::DeviceType::PrivateUse1 || impl->is_conj() || impl->is_neg() ||
      impl->layout() != c10::kStrided || impl->is_wrapped_number()) {
    return false;
  }
  key.push_back(T_TENSOR);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  key.push_back(static_cast<int64_t>(sizes.size()));
  bool degenerate = false;  // a size-0 or size-1 dim: some strides key as canonical values
  for (int64_t v : sizes) {  // (a loop: ranges this short cost more through insert)
    key.push_back(v);
    degenerate = degenerate || v <= 1;
  }
  if (degenerate) canonical_stride_words(sizes, strides, key);
  else for (int64_t v : strides) key.push_back(v);
  return true;
}

inline bool scalar_word(const c10::IValue& v, Key& key) {  // a run-time Scalar: its type only
  if (v.isDouble()) key.push_back(T_DOUBLE);
  else if (v.isInt()) key.push_back(T_INT);
  else if (v.isBool()) key.push_back(T_BOOL);
  else if (v.isComplexDouble()) key.push_back(T_COMPLEX);
  else if (v.isNone()) key.push_back(T_NONE);
  else return false;
  return true;
}

// Not noexcept: libstdc++ then keeps each node's hash, so a lookup compares hashes along its bucket and
// never rehashes a stored key to find where the bucket ends (perf: ~8 us a decode token, 108 lookups).
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t w : k) {
      h ^= static_cast<uint64_t>(w) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

inline int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Write `v` into a 0-d CPU tensor of a common dtype, with fill_'s checked conversion; false for other
// dtypes. Writing directly skips at::scalar_tensor's two dispatcher calls (~1-2 us of a ~5 us op).
bool write_0d(const at::Tensor& t, const c10::Scalar& v) {
  switch (t.scalar_type()) {
    case at::kFloat: *t.mutable_data_ptr<float>() = v.to<float>(); return true;
    case at::kDouble: *t.mutable_data_ptr<double>() = v.to<double>(); return true;
    case at::kLong: *t.mutable_data_ptr<int64_t>() = v.to<int64_t>(); return true;
    case at::kInt: *t.mutable_data_ptr<int32_t>() = v.to<int32_t>(); return true;
    case at::kBool: *t.mutable_data_ptr<bool>() = v.to<bool>(); return true;
    default: return false;
  }
}

// A 0-d CPU tensor of `dtype` holding `v`.
at::Tensor scalar_0d(const c10::Scalar& v, c10::ScalarType dtype) {
  at::Tensor t = at::detail::empty_cpu({}, dtype);
  return write_0d(t, v) ? t : at::scalar_tensor(v, at::TensorOptions().dtype(dtype));
}

// A 0-d CPU tensor of `dtype` holding `v`, for the k-th run-time Scalar of a call: one kept per thread and
// slot, refilled while nothing else holds it or its memory (the container lets go of its inputs when a call
// returns), so `add`'s alpha costs no allocation a launch (three: the tensor, its storage, its byte).
at::Tensor pooled_0d(size_t k, const c10::Scalar& v, c10::ScalarType dtype) {
  thread_local c10::SmallVector<at::Tensor, 4> pool;
  if (k < pool.size() && pool[k].defined() && pool[k].scalar_type() == dtype && pool[k].use_count() == 1 &&
      pool[k].storage().use_count() == 1 && write_0d(pool[k], v)) {
    return pool[k];
  }
  at::Tensor t = scalar_0d(v, dtype);
  if (k >= pool.size()) pool.resize(k + 1);
  pool[k] = t;
  return t;
}

// A 1-D view of dense CPU tensor `t` (its numel elements from its offset) for a flat class's kernel, in
// slot k of the thread's pool: a TensorImpl refilled while nothing else holds it, as `pooled_0d`'s, so a
// flat launch makes no view (CPU's `as_strided` cost ~750 instructions and an allocation a tensor).
// `release_flat` lets go of the storage after the call, so a pooled view never keeps memory alive.
c10::SmallVector<at::Tensor, 4>& flat_pool() {
  thread_local c10::SmallVector<at::Tensor, 4> pool;
  return pool;
}

at::Tensor pooled_flat(size_t k, const at::Tensor& t) {
  auto& pool = flat_pool();
  if (k >= pool.size()) pool.resize(k + 1);
  at::Tensor& v = pool[k];
  if (v.defined() && v.use_count() == 1) {
    v.unsafeGetTensorImpl()->set_storage_and_dtype(t.storage(), t.dtype());
  } else {
    v = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                 t.dtype());
  }
  const int64_t n = t.numel(), one = 1;
  v.unsafeGetTensorImpl()->set_sizes_and_strides({&n, 1}, {&one, 1}, t.storage_offset());
  return v;
}

void release_flat(size_t used) {
  static const c10::Storage empty(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, c10::Device(c10::kCPU)),
                                  nullptr, false);
  auto& pool = flat_pool();
  for (size_t k = 0; k < used && k < pool.size(); ++k) {
    if (pool[k].defined() && pool[k].use_count() == 1) {
      pool[k].unsafeGetTensorImpl()->set_storage_and_dtype(empty, pool[k].dtype());
    } else {
      pool[k].reset();  // an output of the call (an identity kernel): it is the caller's now
    }
  }
}

// The value of a wrapped number (a Python number the dispatcher made a 0-d double, long or bool tensor).
c10::Scalar wrapped_value(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return *t.const_data_ptr<double>();
    case at::kLong: return *t.const_data_ptr<int64_t>();
    case at::kBool: return *t.const_data_ptr<bool>();
    default: return t.item();
  }
}

// How an `aoti` executable runs without Python (its `__neuron_aoti__`): AOTInductor's container runner,
// called with the tensors, then each run-time Scalar as a 0-d tensor of `scalar_dtypes`; numbers in
// tensor slots (`wrapped`, by index in the tensor list) as 0-d tensors of their dtype. The runner is
// owned by the executable (its Python loader), which the holder keeps alive. `flat`: the kernel of a
// flat shape class (neuron_runtime/signatures/_shapes.py, the rank-collapse rule), a 1-D kernel called on 1-D views
// of the inputs (which all have the same sizes and dense strides), its outputs viewed back with the first
// input's sizes and strides; inputs already 1-D and contiguous are passed as they are.
// `packed`: the kernel of a packed class (signatures/_packed.py: small row slices of any row stride), compiled
// for its slices described contiguous: an input that is not dense (a slice) is copied first (at most
// PACK_MAX_NUMEL elements); a dense one (contiguous or permuted) has the layout the kernel was made for.
// `written`: an in-place kernel's inputs it stores into (compiler/_inplace.py, `InPlace`); it was compiled
// for inputs that do not overlap, so a call where one of them shares a byte with another input does not
// run here (`overlaps`): the Python executable runs the in-place aten op on the host for it.
// `src`'s elements in row-major order into `dst` (bits copied as T: any dtype of T's size).
template <class T>
void copy_rows(const at::Tensor& src, T* dst) {
  const T* base = static_cast<const T*>(src.const_data_ptr());
  const auto sizes = src.sizes();
  const auto strides = src.strides();
  const int64_t nd = src.dim(), inner = sizes[nd - 1], step = strides[nd - 1], n = src.numel();
  c10::SmallVector<int64_t, 6> idx(nd, 0);
  int64_t off = 0;
  for (int64_t done = 0; done < n; done += inner) {
    for (int64_t i = 0; i < inner; ++i) *dst++ = base[off + i * step];
    for (int64_t d = nd - 2; d >= 0; --d) {  // the next row
      if (++idx[d] < sizes[d]) {
        off += strides[d];
        break;
      }
      off -= (sizes[d] - 1) * strides[d];
      idx[d] = 0;
    }
  }
}

// A packed class's input that is not dense (a small slice: at most PACK_MAX_NUMEL elements) as a
// contiguous copy, element by element: `contiguous()` is clone, empty_like, empty and copy_ through the
// dispatcher, ~1.5 us for the 32 floats of a rotary half (a decode token copies 7).
at::Tensor packed_copy(const at::Tensor& t) {
  if (t.is_conj() || t.is_neg()) return t.contiguous();
  at::Tensor out = at::detail::empty_cpu(t.sizes(), t.scalar_type());
  switch (t.element_size()) {
    case 1: copy_rows(t, static_cast<uint8_t*>(out.mutable_data_ptr())); return out;
    case 2: copy_rows(t, static_cast<uint16_t*>(out.mutable_data_ptr())); return out;
    case 4: copy_rows(t, static_cast<uint32_t*>(out.mutable_data_ptr())); return out;
    case 8: copy_rows(t, static_cast<uint64_t*>(out.mutable_data_ptr())); return out;
    default: return t.contiguous();
  }
}

// AOTInductor's container entry points, read once from its runner (protected members, reached through
// member pointers): AOTIModelContainerRunner::run wraps every call in three vectors, a hash map of the
// output handles and a call for the output count (perf: ~0.2 us and six allocations a launch).
struct RunnerAccess : torch::inductor::AOTIModelContainerRunner {
  static constexpr auto model_so = &RunnerAccess::model_so_;
  static constexpr auto num_outputs_func = &RunnerAccess::get_num_outputs_func_;
  static constexpr auto container = &RunnerAccess::container_handle_;
  static constexpr auto proxy = &RunnerAccess::proxy_executor_handle_;
};

// One executable's runs, one at a time. Every run of an `aoti` executable goes through `AotiCall::call`
// (the native paths, and the Python executable's `aoti_runner`), which takes the container's single-
// threaded entry under this lock: the container's own `run` takes a shared lock, a mutex twice, a
// condition variable and a temporary buffer to hand its one model instance around (perf: ~0.35 us a
// launch, ~35 us a decoded token). Uncontended: one compare-exchange and one exchange; a second thread
// sleeps in the kernel (a futex) while a long run holds it. Striped by container (runs never nest).
struct alignas(64) RunLock {
  std::atomic<int> s{0};  // 0 free, 1 held, 2 held and maybe waited for
  void lock() {
    int c = 0;
    if (s.compare_exchange_strong(c, 1, std::memory_order_acquire)) return;
    if (c != 2) c = s.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      syscall(SYS_futex, reinterpret_cast<int*>(&s), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
      c = s.exchange(2, std::memory_order_acquire);
    }
  }
  void unlock() {
    if (s.exchange(0, std::memory_order_release) == 2) {
      syscall(SYS_futex, reinterpret_cast<int*>(&s), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    }
  }
};
RunLock g_run_locks[64];
RunLock& run_lock(const void* container) { return g_run_locks[(reinterpret_cast<uintptr_t>(container) >> 4) % 64]; }

struct AotiCall {
  torch::inductor::AOTIModelContainerRunner* runner = nullptr;
  decltype(&AOTInductorModelContainerRun) run_func = nullptr;
  AOTInductorModelContainerHandle container = nullptr;
  AOTIProxyExecutorHandle proxy = nullptr;
  size_t n_outputs = 0;
  std::vector<c10::ScalarType> scalar_dtypes;
  std::vector<std::pair<size_t, c10::ScalarType>> wrapped;
  bool flat = false;
  bool packed = false;
  std::vector<size_t> written;

  // Read from the executable; stays unset (runner null) for anything else, e.g. a runner type this
  // build does not know: the holder then calls the executable from Python.
  void read(py::handle exe) {
    py::object aoti = py::getattr(exe, "__neuron_aoti__", py::none());
    if (aoti.is_none()) return;
    try {
      auto t = aoti.cast<py::tuple>();
      for (py::handle d : t[1]) scalar_dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
      for (py::handle w : t[2]) {
        auto pair = w.cast<py::tuple>();
        wrapped.emplace_back(pair[0].cast<size_t>(), reinterpret_cast<THPDtype*>(pair[1].ptr())->scalar_type);
      }
      if (t.size() > 3) flat = t[3].cast<bool>();
      if (t.size() > 4) written = t[4].cast<std::vector<size_t>>();
      if (t.size() > 5) packed = t[5].cast<bool>();
      if (!open(t[0].cast<torch::inductor::AOTIModelContainerRunnerCpu*>())) *this = AotiCall();
    } catch (const std::exception&) {
      *this = AotiCall();
    }
  }

  // The runner's container and its single-threaded entry (`RunLock`); false if it has none (an .so
  // this build does not know): then nothing here runs it, and Python calls the runner's own `run`.
  bool open(torch::inductor::AOTIModelContainerRunnerCpu* r) {
    try {
      run_func = reinterpret_cast<decltype(run_func)>(
          (r->*RunnerAccess::model_so)->sym("AOTInductorModelContainerRunSingleThreaded"));
    } catch (const std::exception&) {
      return false;
    }
    container = r->*RunnerAccess::container;
    proxy = r->*RunnerAccess::proxy;
    runner = r;
    return run_func != nullptr &&
           (r->*RunnerAccess::num_outputs_func)(container, &n_outputs) == AOTI_RUNTIME_SUCCESS;
  }

  // Whether a written input shares a byte with another input (or is written twice): each tensor's byte
  // span, sorted by start, swept once (compiler/_inplace.py's `writes_overlap`, the same rule).
  bool overlaps(const std::vector<at::Tensor>& in) const {
    struct Span { uintptr_t a, b; bool w; };
    std::vector<Span> spans;
    spans.reserve(in.size());
    std::vector<bool> is_written(in.size(), false);
    for (size_t i : written) {
      if (i >= in.size()) return true;  // not the call the artifact was made for
      is_written[i] = true;
    }
    for (size_t i = 0; i < in.size(); ++i) {
      const at::Tensor& t = in[i];
      if (t.numel() == 0) continue;
      int64_t lo = 0, hi = 0;
      for (int64_t d = 0; d < t.dim(); ++d) {
        const int64_t ext = (t.size(d) - 1) * t.stride(d);
        if (ext < 0) lo += ext; else hi += ext;
      }
      const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      const int64_t e = static_cast<int64_t>(t.element_size());
      spans.push_back({p + lo * e, p + (hi + 1) * e, is_written[i]});
    }
    std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.a < y.a; });
    uintptr_t end_any = 0, end_written = 0;
    for (const Span& sp : spans) {
      if (sp.a < end_written || (sp.w && sp.a < end_any)) return true;
      end_any = std::max(end_any, sp.b);
      if (sp.w) end_written = std::max(end_written, sp.b);
    }
    return false;
  }

  // The container's run with the handles it takes: it steals (deletes) each input handle, and hands back
  // a new one per output (one handle may come back twice: each copy but the last is a copy).
  void call(std::vector<at::Tensor>& in, std::vector<at::Tensor>& outs) const {
    c10::SmallVector<AtenTensorHandle, 8> ih;
    for (at::Tensor& t : in) ih.push_back(torch::aot_inductor::tensor_pointer_to_tensor_handle(new at::Tensor(std::move(t))));
    in.clear();
    c10::SmallVector<AtenTensorHandle, 4> oh(n_outputs, nullptr);
    AOTIRuntimeError err;
    {
      std::lock_guard<RunLock> lock(run_lock(container));
      err = run_func(container, ih.data(), ih.size(), oh.data(), oh.size(), nullptr, proxy);
    }
    if (err != AOTI_RUNTIME_SUCCESS) throw std::runtime_error("AOTInductorModelContainerRunSingleThreaded failed");
    outs.clear();
    outs.reserve(n_outputs);
    for (size_t i = 0; i < n_outputs; ++i) {
      if (oh[i] == nullptr) {
        outs.emplace_back();
        continue;
      }
      at::Tensor* p = torch::aot_inductor::tensor_handle_to_tensor_pointer(oh[i]);
      if (std::find(oh.begin() + i + 1, oh.end(), oh[i]) != oh.end()) {
        outs.push_back(*p);
      } else {
        outs.push_back(std::move(*p));
        delete p;
      }
    }
  }

  // `in`: the CPU tensors (wrapped numbers as they came); false if the call does not fit the artifact.
  // The Scalars go in as the thread's pooled 0-d tensors (`pooled_0d`).
  bool run(std::vector<at::Tensor> in, c10::ArrayRef<c10::IValue> scalars, std::vector<at::Tensor>& outs) const {
    return run_into(in, scalars, outs);
  }
  // `run` on the caller's buffer `in` (consumed: left empty, its capacity kept for the next call).
  bool run_into(std::vector<at::Tensor>& in, c10::ArrayRef<c10::IValue> scalars,
                std::vector<at::Tensor>& outs) const {
    if (scalars.size() != scalar_dtypes.size()) return false;
    for (const auto& [i, dtype] : wrapped) {
      if (i >= in.size() || !in[i].unsafeGetTensorImpl()->is_wrapped_number()) return false;
      in[i] = scalar_0d(wrapped_value(in[i]), dtype);
    }
    for (const at::Tensor& t : in) {
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) return false;  // a slot the artifact does not know
    }
    if (!written.empty() && overlaps(in)) return false;
    if (packed) {
      for (at::Tensor& t : in) {
        if (t.dim() > 0 && !t.is_non_overlapping_and_dense()) t = packed_copy(t);
      }
    }
    at::Tensor first;  // flat: the input the outputs take their sizes and strides from
    size_t pooled = 0;
    if (flat) {
      for (at::Tensor& t : in) {
        if (t.dim() == 0) continue;  // a number in a tensor slot
        if (t.dim() == 1 && t.stride(0) == 1) break;  // 1-D already, and so is every input
        if (!first.defined()) first = t;
        t = pooled_flat(pooled++, t);
      }
    }
    for (size_t k = 0; k < scalars.size(); ++k) in.push_back(pooled_0d(k, scalars[k].toScalar(), scalar_dtypes[k]));
    struct Released {  // on every way out, exceptions included
      size_t n;
      ~Released() { if (n) release_flat(n); }
    } released{pooled};
    call(in, outs);
    if (first.defined()) {
      for (at::Tensor& o : outs) {
        if (!o.defined()) continue;
        // A fresh output only this call holds takes the input's sizes and strides in place; anything
        // else (an output that is an input, or one returned twice) gets a view (CPU's own as_strided
        // kernel, called directly: the dispatcher's layers cost ~0.3 us and an allocation a tensor).
        if (o.use_count() == 1 && o.dim() == 1 && o.storage_offset() == 0 && o.numel() == first.numel() &&
            !o.unsafeGetTensorImpl()->is_wrapped_number()) {
          o.unsafeGetTensorImpl()->set_sizes_and_strides(first.sizes(), first.strides());
        } else {
          o = at::native::as_strided_tensorimpl(o, first.sizes(), first.strides(), std::nullopt);
        }
      }
    }
    return true;
  }
};

// The Python executable's run of an `aoti` artifact (compiler/_runner.py) when this extension is loaded:
// the same single-threaded entry under the same lock as the native paths (a container entered both ways
// would hand its one model instance around under two disciplines). Keeps the runner (`loader`) alive.
struct AotiRunner {
  py::object loader;
  AotiCall aoti;
  std::vector<at::Tensor> operator()(std::vector<at::Tensor> in) const {
    std::vector<at::Tensor> outs;
    py::gil_scoped_release no_gil;
    aoti.call(in, outs);
    return outs;
  }
};

py::object aoti_runner(py::object loader) {
  AotiRunner r{loader, {}};
  try {
    if (!r.aoti.open(loader.cast<torch::inductor::AOTIModelContainerRunnerCpu*>())) return py::none();
  } catch (const std::exception&) {
    return py::none();
  }
  return py::cast(std::move(r));
}

// Call an executable from Python as `exe(tensors, scalars)`; its outputs (None as an undefined tensor),
// or false if it raised or returned something else.
bool call_exe(PyObject* exe, const py::list& tensors, const py::list& scalars, std::vector<at::Tensor>& outs) {
  py::object r = py::reinterpret_steal<py::object>(
      PyObject_CallFunctionObjArgs(exe, tensors.ptr(), scalars.ptr(), nullptr));
  if (!r) {
    PyErr_Clear();
    return false;
  }
  for (py::handle o : r) {
    if (o.is_none()) outs.emplace_back();
    else if (THPVariable_Check(o.ptr())) outs.push_back(THPVariable_Unpack(o.ptr()));
    else return false;
  }
  return true;
}

// How the profiler's device track names an executable's runs: its `__neuron_trace__` (name, key, kind,
// shape class), set when it entered the memory tier (executables/_resolver.py); read with the GIL held.
std::shared_ptr<const neuron_trace::Label> read_label(py::handle exe) {
  static const auto* unnamed = new std::shared_ptr<const neuron_trace::Label>(
      neuron_trace::label_of("executable", "", "op", "exact"));
  py::object t = py::getattr(exe, "__neuron_trace__", py::none());
  if (t.is_none()) return *unnamed;
  try {
    auto l = t.cast<py::tuple>();
    return neuron_trace::label_of(l[0].cast<std::string>(), l[1].cast<std::string>(), l[2].cast<std::string>(),
                                  l[3].cast<std::string>());
  } catch (const std::exception&) {
    return *unnamed;
  }
}

// An executable the Python slow path made for a key, run without Python when it says how:
//   aten    a `reference` executable: the functional aten op on host memory;
//   aoti    an `aoti` executable (AotiCall);
// otherwise `exe(tensors, scalars)` is called (one Python call).
struct Entry {
  std::optional<c10::OperatorHandle> aten;
  AotiCall aoti;
  PyObject* exe = nullptr;  // strong reference; the GIL is taken to release it
  std::shared_ptr<const neuron_trace::Label> label;  // its runs on the profiler's device track (trace.h)
  bool inplace = false;      // the executable writes the mutated arguments itself (compiler._base)
  bool python_only = false;  // the slow path keeps no executable for this key (a host fallback), or
                             // fusion queues these calls and this file cannot (its Python kernel does)
  // Fusion queues these calls in the native queue (below): the Python op info and key to hand a group
  // to Python with, and each output's (sizes, strides, dtype) for a functional op.
  bool queue = false;
  PyObject* pyinfo = nullptr;
  PyObject* pykey = nullptr;
  std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, c10::ScalarType>> outmeta;
  ~Entry() {
    if (Py_IsInitialized() && (exe != nullptr || pyinfo != nullptr || pykey != nullptr)) {
      py::gil_scoped_acquire gil;
      Py_XDECREF(exe);
      Py_XDECREF(pyinfo);
      Py_XDECREF(pykey);
    }
  }
};

struct OpState;

// ---------------------------------------------------------------------------------------------------
// The native fusion queue (TORCH_NEURONX_ENABLE_CONCATENATION=1 with this file loaded). Fusion's logic
// stays in Python (neuron_runtime/aten/_fusion.py); this is its hit path. A call Python says to queue is
// queued here: its outputs are allocated from the metadata Python learned, an in-place op returns its
// argument. Python's queue holds one marker while this one is not empty, so every flush trigger it
// knows reaches `run_queue`. There, the group's structure (each op's table entry and how its tensors
// are wired) and which results are still readable form a key; a group Python has compiled fused runs
// here in one call. Everything else (a group not seen often enough yet, a failure) is handed to Python
// as `fusion._flush_from_native(nodes, live)`, which runs it as its own queue would and says which
// fused executable it used. The queue's state is guarded by the GIL.
// ---------------------------------------------------------------------------------------------------
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct QNode {
  OpState* op = nullptr;
  std::shared_ptr<Entry> e;
  std::vector<at::Tensor> ins;       // the executable's tensor slots: neuron tensors, wrapped numbers, or
                                     // undefined where `wire` names the queued op whose result it reads
  std::vector<std::pair<int64_t, int64_t>> wire;  // per slot: (node, output), or (-1, -1) for ins[k]
  std::vector<std::vector<int64_t>> view;  // per slot: empty, or how a wired slot views its writer's result
                                           // (rank, sizes, strides, storage offset): a view of a queued
                                           // op's fresh output, read inside the group (its `as_strided`)
  std::vector<at::Tensor> cpu;       // per slot read from outside the queue: its CPU view, taken when
                                     // queued (a later `x.data = y` cannot change what the op reads)
  std::vector<bool> fresh;           // per dst: a buffer allocated for a queued functional op
  std::vector<c10::IValue> scalars;  // its run-time Scalars, in order
  std::vector<at::Tensor> dsts;      // CPU: fresh buffers, or the CPU views of the tensors updated in place
  std::vector<WeakImpl> ids;         // the neuron tensor behind each dst (weak: its address stays reserved)
  bool inplace = false;
};

struct GroupExe {
  bool each = false;  // Python decided the group runs op by op (`run_each`); nothing below is set
  // with `each`: when to hand the group to Python again (steady clock, ns; 0: never)
  int64_t recheck_at = 0;
  AotiCall aoti;
  PyObject* exe = nullptr;
  std::shared_ptr<const neuron_trace::Label> label;
  ~GroupExe() {
    if (exe != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(exe);
    }
  }
};

std::vector<QNode> g_queue;
std::atomic<int64_t> g_q_run_each{0};
// The CPU views the queued ops took, by neuron tensor (an optimizer's step reads each gradient three
// times and updates tensors it has just read): one view per tensor while its metadata stays the same.
// Each view holds its tensor's storage: a later tensor at the same address gets a new view unless it
// reads the same memory the same way (the checks in queued_view).
std::unordered_map<const c10::TensorImpl*, at::Tensor> g_views;
std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, int64_t>> g_writer;  // last writer per tensor
std::unordered_set<const void*> g_written;  // storage pointers queued ops write
// Per storage a queued op writes: its last writer, when that is a functional op's fresh output (a view
// of it is read inside the group, through the writer's result); (-1, -1) after an in-place write.
std::unordered_map<const void*, std::pair<int64_t, int64_t>> g_fresh_writer;
bool g_qgrad = false, g_qautocast = false;
PyObject* g_started = nullptr;      // fusion._native_started(): Python's queue gets its marker
PyObject* g_from_native = nullptr;  // fusion._flush_from_native(nodes, live) -> executable | None
size_t g_limit = 1024;
std::unordered_map<Key, std::shared_ptr<GroupExe>, KeyHash> g_groups;
int64_t g_groups_generation = 0;
std::atomic<int64_t> g_q_buffered{0}, g_q_fused_runs{0}, g_q_ops_fused{0}, g_q_not_materialised{0};

inline const void* storage_ptr(const at::Tensor& t) { return t.storage().data(); }

at::Tensor queued_view(const at::Tensor& t) {
  at::Tensor& v = g_views[t.unsafeGetTensorImpl()];
  if (!v.defined() || storage_ptr(v) != storage_ptr(t) || v.sizes() != t.sizes() || v.strides() != t.strides() ||
      v.storage_offset() != t.storage_offset() || v.dtype() != t.dtype()) {
    v = to_cpu(t);
  }
  return v;
}

bool view_needs_flush(const c10::IValue& v) {
  py::gil_scoped_acquire gil;  // guards the queue's state
  if (g_queue.empty() || !v.isTensor() || !v.toTensor().defined()) return true;
  // A view of memory queued ops write is metadata too: a queued op reading it is wired to the writer's
  // result through the view (`enqueue`), anything else that reads it runs the queue first.
  return v.toTensor().device().type() != c10::DeviceType::PrivateUse1;
}

// The writer a queued op reading `t` (not itself a queued op's output) reads through a view, or null
// when `t` reads no fresh output of a queued op the same dtype (then the queue runs first).
const std::pair<int64_t, int64_t>* view_writer(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return nullptr;
  auto it = g_fresh_writer.find(storage_ptr(t));
  if (it == g_fresh_writer.end() || it->second.first < 0) return nullptr;
  const at::Tensor& d = g_queue[it->second.first].dsts[it->second.second];
  if (d.dtype() != t.dtype() || d.storage_offset() != 0) return nullptr;
  return &it->second;
}

void flush_for(const std::string& reason) {  // with the GIL: fusion.flush(reason)
  if (g_flush == nullptr) return;
  py::object r = py::reinterpret_steal<py::object>(PyObject_CallFunction(g_flush, "s", reason.c_str()));
  if (!r) throw python_error();
}


// A launch's input and output buffers: the thread's own, kept between launches for their capacity, or, for
// a launch nested in another on this thread (which finds them in use), buffers of its own; both emptied on
// every way out, exceptions included.
struct LaunchBuffers {
  static std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>& kept() {
    thread_local std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> p;
    return p;
  }
  std::vector<at::Tensor> own_in, own_outs;
  const bool mine = kept().first.empty() && kept().second.empty();
  std::vector<at::Tensor>& in = mine ? kept().first : own_in;
  std::vector<at::Tensor>& outs = mine ? kept().second : own_outs;
  ~LaunchBuffers() { in.clear(), outs.clear(); }
};

std::atomic<int64_t> g_executions{0};
std::atomic<int64_t> g_generation{0};  // bumped by clear(): tables drop entries of older generations

struct OpState final : c10::OperatorKernel {
  std::vector<int> kinds;            // per schema argument
  std::vector<bool> kwarg_only;      // per schema argument
  std::vector<std::string> names;    // per schema argument
  int mutated = -1;                  // in-place: the argument the op writes (and returns)
  bool full_overlap_ok = true;        // pointwise: it may read the very tensor it writes in place
  bool several_mutated = false;      // it writes more than one argument (`_fused_adamw_`): only entries
                                     // of in-place executables run here, the others in Python
  std::vector<int> mutated_lists;    // the tensor-list arguments it writes: their version counters are
                                     // bumped here, as CUDA's foreach kernels do (no ADInplaceOrView
                                     // kernel does it for list ops)
  size_t n_returns = 0;
  bool returns_list = false;         // a single Tensor[] return
  PyObject* kernel = nullptr;        // the Python kernel (never released: states live for the process)
  PyObject* lookup = nullptr;        // lookup(*args, **kwargs) -> executable the Python kernel uses, or None
  neuron_memory::SpinLock mu;  // guards `table` and `generation` (a lookup per op: see g_view_mu)
  int64_t generation = 0;
  std::unordered_map<Key, std::shared_ptr<Entry>, KeyHash> table;

  // Build the key; false if this call is not one the native path serves.
  bool build_key(const Stack& stack, size_t base, Key& key) const {
    key.reserve(48);
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (!arg_words(i, stack[base + i], key)) return false;
    }
    return true;
  }

  // The key words of argument `i` (a tensor's: `tensor_arg`), as the stack holds it.
  bool arg_words(size_t i, const c10::IValue& v, Key& key) const {
    switch (kinds[i]) {
      case OUT:  // a CPU `out` for a neuron op is the Python kernel's error to raise
        return v.isTensor() && v.toTensor().defined() &&
               v.toTensor().device().type() == c10::DeviceType::PrivateUse1;
      case TENSOR:
      case OPT_TENSOR:
        if (v.isNone()) return tensor_arg(kinds[i], at::Tensor(), key);
        return v.isTensor() && tensor_arg(kinds[i], v.toTensor(), key);
      case TENSORS: {
        if (!v.isTensorList()) return false;
        const auto& l = v.toTensorList();
        key.push_back(T_LIST);
        key.push_back(static_cast<int64_t>(l.size()));
        for (const at::Tensor& t : l) {
          if (!tensor_words(t, key)) return false;
        }
        return true;
      }
      case OPT_TENSORS: {
        if (!v.isList()) return false;
        const auto l = v.toListRef();
        key.push_back(T_LIST);
        key.push_back(static_cast<int64_t>(l.size()));
        for (const c10::IValue& x : l) {  // C++ indexing (`x[:, i]`) passes an absent index undefined
          if (!present(x)) key.push_back(T_NONE);
          else if (!tensor_words(x.toTensor(), key)) return false;
        }
        return true;
      }
      case SCALAR:
        return scalar_word(v, key);
      case SCALARS: {
        if (v.isNone()) {
          key.push_back(T_NONE);
          return true;
        }
        if (!v.isList()) return false;
        const auto& l = v.toListRef();
        key.push_back(T_LIST);
        key.push_back(static_cast<int64_t>(l.size()));
        for (const c10::IValue& x : l) {
          if (!scalar_word(x, key)) return false;
        }
        return true;
      }
      case VALUE:
        return value_words(v, key);
      default:
        return false;
    }
  }

  // A tensor argument's key words: None for an absent optional one (C++ callers pass it undefined), a
  // wrapped number by its dtype, else `tensor_words`.
  static bool tensor_arg(int kind, const at::Tensor& t, Key& key) {
    if (!t.defined()) {
      if (kind != OPT_TENSOR) return false;
      key.push_back(T_NONE);
      return true;
    }
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
      if (kind != TENSOR) return false;
      key.push_back(T_WRAPPED);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      return true;
    }
    return tensor_words(t, key);
  }

  static bool value_words(const c10::IValue& v, Key& key) {
    if (v.isNone()) {
      key.push_back(T_NONE);
    } else if (v.isBool()) {
      key.push_back(T_BOOL);
      key.push_back(v.toBool());
    } else if (v.isInt()) {
      key.push_back(T_INT);
      key.push_back(v.toInt());
    } else if (v.isDouble()) {
      key.push_back(T_DOUBLE);
      key.push_back(bits_of(v.toDouble()));
    } else if (v.isIntList()) {
      auto l = v.toIntList();
      key.push_back(T_INTLIST);
      key.push_back(static_cast<int64_t>(l.size()));
      for (int64_t x : l) key.push_back(x);
    } else if (v.isBoolList()) {
      auto l = v.toBoolList();
      key.push_back(T_BOOLLIST);
      key.push_back(static_cast<int64_t>(l.size()));
      for (bool x : l) key.push_back(x);
    } else if (v.isDoubleList()) {
      auto l = v.toDoubleList();
      key.push_back(T_DOUBLELIST);
      key.push_back(static_cast<int64_t>(l.size()));
      for (double x : l) key.push_back(bits_of(x));
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      key.push_back(T_STRING);
      key.push_back(static_cast<int64_t>(s.size()));
      for (char c : s) key.push_back(c);
    } else if (v.isDevice()) {
      key.push_back(T_DEVICE);
      key.push_back(static_cast<int64_t>(v.toDevice().type()));
      key.push_back(v.toDevice().index());
    } else {
      return false;
    }
    return true;
  }

  std::shared_ptr<Entry> find(const Key& key) {
    std::lock_guard<neuron_memory::SpinLock> lock(mu);
    if (generation != g_generation.load(std::memory_order_relaxed)) return nullptr;
    auto it = table.find(key);
    return it == table.end() ? nullptr : it->second;
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, Stack* stack) {
    const size_t n = kinds.size();
    const size_t base = stack->size() - n;
    // One key buffer per thread, as Typed's: a call nested in this one (fusion's flush, the Python kernel)
    // reuses it, so after the lookup only a miss reads it, from a copy taken before anything else runs.
    thread_local Key key;
    key.clear();
    bool keyed = build_key(*stack, base, key);
    if (keyed) {
      std::shared_ptr<Entry> e = find(key);
      if (e && e->queue) {  // (an entry learned while fusion was on: only queued while it still is)
        if (g_from_native == nullptr || !enqueue(op, e, stack, base)) call_python(op, stack, base, nullptr);
        return;
      }
      // A write that may partially overlap an input goes to the Python kernel, which decides as CPU's
      // TensorIterator does (raise, or run with the aliasing intact): an executable computes as if the
      // inputs were copies. (`add` and every op that writes nothing never get here: `mutated < 0`.)
      if (e && mutated >= 0 && !several_mutated && writes_overlap(*stack, base)) {
        return call_python(op, stack, base, nullptr);
      }
      // Queued ops run first (the Python kernel sees to that itself on the other paths).
      if (e && !e->python_only && g_pending.load(std::memory_order_relaxed)) flush_queued(op);
      const bool traced = neuron_trace::on();  // a profiler records device activity (trace.h)
      const int64_t t0 = C10_UNLIKELY(traced) ? neuron_trace::now() : 0;
      if (e && !e->python_only && run(*e, stack, base)) {
        g_executions.fetch_add(1, std::memory_order_relaxed);
        if (C10_UNLIKELY(traced)) neuron_trace::record(e->label, neuron_trace::OPS, t0);
        return;
      }
      if (e) keyed = false;  // known: nothing to learn
    }
    if (!keyed) return call_python(op, stack, base, nullptr);
    const Key own(key);
    call_python(op, stack, base, &own);
  }

  // Queue a call fusion queues (see QNode). False, with nothing done, for a call the native queue does
  // not take (a CPU tensor where a neuron one is expected): the Python kernel then queues it itself.
  bool enqueue(const c10::OperatorHandle& op, const std::shared_ptr<Entry>& e, Stack* stack, size_t base) {
    const size_t n = kinds.size();
    QNode node;
    node.op = this;
    node.e = e;
    node.inplace = mutated >= 0;
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      if (kinds[i] == TENSOR || kinds[i] == OPT_TENSOR) {
        if (!v.isTensor() || !v.toTensor().defined()) continue;
        const at::Tensor& t = v.toTensor();
        if (!t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().type() != c10::DeviceType::PrivateUse1) {
          return false;
        }
        node.ins.push_back(t);
      } else if (kinds[i] == TENSORS) {
        for (const at::Tensor& t : v.toTensorList()) {
          if (t.device().type() != c10::DeviceType::PrivateUse1) return false;
          node.ins.push_back(t);
        }
      } else if (kinds[i] == OPT_TENSORS) {
        return false;  // not queued here: the Python kernel queues it
      } else if (kinds[i] == SCALAR && !v.isNone()) {
        node.scalars.push_back(v);
      } else if (kinds[i] == SCALARS && !v.isNone()) {
        for (const c10::IValue& x : v.toListRef()) node.scalars.push_back(x);
      }
    }
    std::vector<at::Tensor> targets;
    if (node.inplace) {
      const c10::IValue& m = (*stack)[base + mutated];
      if (m.isTensorList()) {
        for (const at::Tensor& t : m.toTensorList()) targets.push_back(t);
      } else {
        targets.push_back(m.toTensor());
      }
    } else if (e->outmeta.empty()) {
      return false;
    }
    py::gil_scoped_acquire gil;
    const auto& name = op.operator_name();
    if (g_queue.empty() && g_pending.load()) {  // ops Python queued run first
      flush_for("op:" + name.name + (name.overload_name.empty() ? "" : "." + name.overload_name));
    }
    bool grad = at::GradMode::is_enabled();
    bool autocast = at::autocast::is_autocast_enabled(c10::DeviceType::PrivateUse1);
    if (!g_queue.empty() && (grad != g_qgrad || autocast != g_qautocast)) flush_for("grad_or_autocast");
    if (!g_queue.empty()) {
      auto reads_other_view = [](const at::Tensor& t) {
        return !t.unsafeGetTensorImpl()->is_wrapped_number() && !g_writer.count(t.unsafeGetTensorImpl()) &&
               g_written.count(storage_ptr(t));
      };
      if (std::any_of(node.ins.begin(), node.ins.end(),
                      [&](const at::Tensor& t) { return reads_other_view(t) && view_writer(t) == nullptr; }) ||
          std::any_of(targets.begin(), targets.end(), reads_other_view)) {
        flush_for("reads_pending_memory");
      }
    }
    g_qgrad = grad;
    g_qautocast = autocast;
    const int64_t j = static_cast<int64_t>(g_queue.size());
    // Wire reads of queued results now, holding no reference to them (a result nobody else holds is
    // never written back).
    for (at::Tensor& t : node.ins) {
      auto w = t.unsafeGetTensorImpl()->is_wrapped_number() ? g_writer.end() : g_writer.find(t.unsafeGetTensorImpl());
      const std::pair<int64_t, int64_t>* vw = w == g_writer.end() ? view_writer(t) : nullptr;
      if (vw != nullptr) {  // a view of a queued op's fresh output: read through its result
        node.wire.push_back(*vw);
        node.cpu.push_back(queued_view(t));
        std::vector<int64_t> spec{t.dim()};
        for (int64_t x : t.sizes()) spec.push_back(x);
        for (int64_t x : t.strides()) spec.push_back(x);
        spec.push_back(t.storage_offset());
        node.view.push_back(std::move(spec));
      } else if (w == g_writer.end()) {
        node.wire.emplace_back(-1, -1);
        node.cpu.push_back(t.unsafeGetTensorImpl()->is_wrapped_number() ? t : queued_view(t));
        node.view.emplace_back();
      } else {
        node.wire.push_back(w->second);
        node.cpu.emplace_back();
        node.view.emplace_back();
        t = at::Tensor();
      }
    }
    std::vector<at::Tensor> outs;
    if (node.inplace) {
      for (const at::Tensor& t : targets) {
        auto w = g_writer.find(t.unsafeGetTensorImpl());
        if (w != g_writer.end()) {  // written by a queued op: the same host buffer
          const QNode& prev = g_queue[w->second.first];
          node.dsts.push_back(prev.dsts[w->second.second]);
          node.fresh.push_back(prev.fresh[w->second.second]);
        } else {
          node.dsts.push_back(queued_view(t));
          node.fresh.push_back(false);
        }
        node.ids.emplace_back(t.getIntrusivePtr());
      }
    } else {
      for (const auto& [sizes, strides, dtype] : e->outmeta) {
        at::Tensor d = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
        outs.push_back(to_neuron(d));
        node.dsts.push_back(std::move(d));
        node.fresh.push_back(true);
        node.ids.emplace_back(outs.back().getIntrusivePtr());
      }
    }
    for (size_t i = 0; i < node.dsts.size(); ++i) {
      g_writer[node.ids[i]._unsafe_get_target()] = {j, static_cast<int64_t>(i)};
      g_written.insert(storage_ptr(node.dsts[i]));
      g_fresh_writer[storage_ptr(node.dsts[i])] =
          node.inplace ? std::pair<int64_t, int64_t>{-1, -1} : std::pair<int64_t, int64_t>{j, static_cast<int64_t>(i)};
    }
    c10::IValue self = node.inplace && !(*stack)[base + mutated].isTensorList() ? (*stack)[base + mutated]
                                                                                 : c10::IValue();
    g_queue.push_back(std::move(node));
    g_q_buffered.fetch_add(1, std::memory_order_relaxed);
    torch::jit::drop(*stack, n);
    if (self.isTensor()) {
      stack->push_back(std::move(self));
    } else if (!outs.empty()) {
      if (returns_list) {
        c10::List<at::Tensor> l;
        for (at::Tensor& o : outs) l.push_back(std::move(o));
        stack->emplace_back(std::move(l));
      } else {
        for (at::Tensor& o : outs) stack->emplace_back(std::move(o));
      }
    }
    if (j == 0 && g_started != nullptr) {
      py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(g_started));
      if (!r) throw python_error();
    }
    if (g_queue.size() >= g_limit) flush_for("buffer_limit");
    return true;
  }

  // Whether tensors `a` and `b` (distinct) cover intersecting bytes: exact for the dense tensors CPU checks
  // (a non-dense one CPU lets pass: the Python kernel's exact rule decides then).
  // An out= tensor (`out`) counts as meeting itself (many ops refuse an out= that is an input: CPU's
  // `assert_no_overlap`), an in-place one does not (`x.add_(x)` is fine); and an out= tensor's span runs
  // to its storage's end (and one with internal overlap meets everything): CPU resizes an out= of another
  // shape in place before it checks (`ind[:1]` grows into `ind[1:]`), so the Python kernel decides exactly
  // (`_writes.overlapping`).
  static bool spans_meet(const at::Tensor& a, const at::Tensor& b, bool out, bool full_ok = true) {
    if (!b.defined() || b.unsafeGetTensorImpl()->is_wrapped_number()) return false;
    // (empty ones too; a non-pointwise op reading the tensor it writes in place: `_writes.full_overlap_ok`)
    if (a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl()) return out || !full_ok;
    if (a.numel() == 0) return false;
    const char* pa = static_cast<const char*>(a.data_ptr());
    const char* pb = static_cast<const char*>(b.data_ptr());
    if (pa < pb + b.nbytes() && pb < pa + a.nbytes()) return true;
    if (!out) return false;
    // (an out= tensor whose elements share memory: CPU refuses it, "more than one element ...")
    if (!a.is_non_overlapping_and_dense() && at::has_internal_overlap(a) == at::MemOverlap::Yes) return true;
    if (pb < pa) return false;  // `b` lies before `a`: a resize grows `a` upwards only
    const c10::Storage& st = a.storage();
    return pb < static_cast<const char*>(st.data()) + st.nbytes();
  }

  // Whether the argument this op writes may partially overlap one it reads (element by element for two
  // lists, as CPU's foreach ops check them). Cold: an in-place op's inputs are rarely views of its output.
  bool writes_overlap(const Stack& stack, size_t base) const {
    const c10::IValue& w = stack[base + mutated];
    const bool out = kinds[mutated] == OUT;
    const bool full = full_overlap_ok;
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (static_cast<int>(i) == mutated) continue;
      const c10::IValue& v = stack[base + i];
      if ((kinds[i] == TENSOR || kinds[i] == OPT_TENSOR) && v.isTensor()) {
        if (w.isTensor()) {
          if (spans_meet(w.toTensor(), v.toTensor(), out, full)) return true;
        } else if (w.isTensorList()) {
          for (const at::Tensor& t : w.toTensorList()) {
            if (spans_meet(t, v.toTensor(), out, full)) return true;
          }
        }
      } else if (kinds[i] == TENSORS && v.isTensorList()) {
        const auto& l = v.toTensorList();
        if (w.isTensorList() && w.toTensorList().size() == l.size()) {
          const auto& wl = w.toTensorList();
          for (size_t j = 0; j < l.size(); ++j) {
            if (spans_meet(wl.get(j), l.get(j), out, full)) return true;
          }
        } else if (w.isTensor()) {
          for (const at::Tensor& t : l) {
            if (spans_meet(w.toTensor(), t, out, full)) return true;
          }
        }
      }
    }
    return false;
  }

  // The hit path. Returns false (stack untouched) if the executable raised: the Python kernel then
  // decides (the user's error, or a fallback to the host).
  bool run(const Entry& e, Stack* stack, size_t base) {
    const size_t n = kinds.size();
    LaunchBuffers buffers;
    std::vector<at::Tensor>& in = buffers.in;
    std::vector<at::Tensor>& outs = buffers.outs;
    try {
      if (e.aten) {
        Stack cpu;
        cpu.reserve(n);
        for (size_t i = 0; i < n; ++i) {
          const c10::IValue& v = (*stack)[base + i];
          if ((kinds[i] == TENSOR || kinds[i] == OPT_TENSOR) && v.isTensor() && v.toTensor().defined() &&
              !v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
            cpu.emplace_back(cpu_view(v.toTensor()));
          } else if (kinds[i] == TENSORS) {
            c10::List<at::Tensor> l;
            l.reserve(v.toTensorList().size());
            for (const at::Tensor& t : v.toTensorList()) l.push_back(cpu_view(t));
            cpu.emplace_back(std::move(l));
          } else if (kinds[i] == OPT_TENSORS) {
            c10::List<std::optional<at::Tensor>> l;
            for (const c10::IValue& x : v.toListRef()) {
              l.push_back(present(x) ? std::optional<at::Tensor>(cpu_view(x.toTensor())) : std::nullopt);
            }
            cpu.emplace_back(std::move(l));
          } else if (kinds[i] != OUT) {
            cpu.push_back(v);
          }
        }
        e.aten->redispatchBoxed(kCpuKeys, &cpu);
        outs.reserve(cpu.size());
        for (auto& r : cpu) {
          if (r.isTensorList()) {
            for (const at::Tensor& t : r.toTensorList()) outs.push_back(t);
          } else {
            outs.push_back(r.isTensor() ? r.toTensor() : at::Tensor());
          }
        }
      } else if (e.aoti.runner != nullptr) {
        c10::SmallVector<c10::IValue, 4> scalars;
        in.reserve(n);
        for (size_t i = 0; i < n; ++i) {
          const c10::IValue& v = (*stack)[base + i];
          if (kinds[i] == TENSOR || kinds[i] == OPT_TENSOR) {
            if (!v.isTensor() || !v.toTensor().defined()) continue;
            const at::Tensor& t = v.toTensor();
            in.push_back(t.unsafeGetTensorImpl()->is_wrapped_number() ? t : cpu_view(t));
          } else if (kinds[i] == TENSORS) {
            for (const at::Tensor& t : v.toTensorList()) in.push_back(cpu_view(t));
          } else if (kinds[i] == OPT_TENSORS) {
            for (const c10::IValue& x : v.toListRef()) {
              if (present(x)) in.push_back(cpu_view(x.toTensor()));
            }
          } else if (kinds[i] == SCALAR && !v.isNone()) {
            scalars.push_back(v);
          } else if (kinds[i] == SCALARS && !v.isNone()) {
            for (const c10::IValue& x : v.toListRef()) scalars.push_back(x);
          }
        }
        if (!e.aoti.run_into(in, scalars, outs)) return false;
      } else {
        py::gil_scoped_acquire gil;
        py::list tensors, scalars;
        for (size_t i = 0; i < n; ++i) {
          const c10::IValue& v = (*stack)[base + i];
          if (kinds[i] == TENSOR || kinds[i] == OPT_TENSOR) {
            if (!v.isTensor() || !v.toTensor().defined()) continue;  // an absent optional tensor
            const at::Tensor& t = v.toTensor();
            if (t.unsafeGetTensorImpl()->is_wrapped_number()) tensors.append(number(t));
            else tensors.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(to_cpu(t))));
          } else if (kinds[i] == TENSORS) {
            for (const at::Tensor& t : v.toTensorList()) {
              tensors.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(to_cpu(t))));
            }
          } else if (kinds[i] == OPT_TENSORS) {
            for (const c10::IValue& x : v.toListRef()) {
              if (!present(x)) continue;
              tensors.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(to_cpu(x.toTensor()))));
            }
          } else if (kinds[i] == SCALAR && !v.isNone()) {
            scalars.append(torch::jit::toPyObject(v));
          } else if (kinds[i] == SCALARS && !v.isNone()) {
            for (const c10::IValue& x : v.toListRef()) scalars.append(torch::jit::toPyObject(x));
          }
        }
        if (!call_exe(e.exe, tensors, scalars, outs)) return false;
      }
      if (mutated >= 0) {
        const c10::IValue& target = (*stack)[base + mutated];
        if (e.inplace) return finish_in_place(stack, base, n);
        if (target.isTensorList()) {  // `_foreach_add_`: every result into its list element
          const auto& l = target.toTensorList();
          if (outs.size() != l.size()) return false;
          for (size_t j = 0; j < l.size(); ++j) cpu_view(l.get(j)).copy_(outs[j]);
          bump_versions(stack, base);
          torch::jit::drop(*stack, n);
          return true;
        }
        if (outs.empty()) return false;
        if (kinds[mutated] == OUT) {  // a result of another dtype or size: the Python kernel casts or resizes
          const at::Tensor& out = target.toTensor();
          if (!outs[0].defined() || outs[0].scalar_type() != out.scalar_type() || outs[0].sizes() != out.sizes()) {
            return false;
          }
        }
        cpu_view(target.toTensor()).copy_(outs[0]);
        c10::IValue self = target;
        torch::jit::drop(*stack, n);
        stack->push_back(std::move(self));
        return true;
      }
      if (!returns_list && outs.size() < n_returns) return false;
    } catch (const std::exception&) {
      return false;
    }
    torch::jit::drop(*stack, n);
    if (returns_list) {
      c10::List<at::Tensor> l;
      l.reserve(outs.size());
      for (at::Tensor& o : outs) l.push_back(to_neuron_fresh(std::move(o)));
      stack->emplace_back(std::move(l));
      return true;
    }
    for (size_t i = 0; i < n_returns; ++i) {
      stack->emplace_back(outs[i].defined() ? to_neuron_fresh(std::move(outs[i])) : at::Tensor());
    }
    return true;
  }

  // An in-place executable wrote the mutated argument already: nothing to copy back, the argument (a
  // tensor) is returned. Out of line and cold, so `run` stays as small for every other op.
  __attribute__((noinline, cold)) bool finish_in_place(Stack* stack, size_t base, size_t n) const {
    bump_versions(stack, base);
    c10::IValue target = (*stack)[base + mutated];
    torch::jit::drop(*stack, n);
    if (target.isTensor()) stack->push_back(std::move(target));
    return true;
  }

  // The written lists' tensors changed in place: autograd must see it (an inference tensor has no counter).
  void bump_versions(Stack* stack, size_t base) const {
    for (int i : mutated_lists) {
      const c10::IValue& v = (*stack)[base + i];
      if (!v.isTensorList()) continue;
      for (const at::Tensor& t : v.toTensorList()) {
        if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
      }
    }
  }

  static py::object number(const at::Tensor& t) {  // a wrapped number as the Python number it was
    switch (t.scalar_type()) {
      case at::kBool: return py::bool_(t.item<bool>());
      case at::kLong: return py::int_(t.item<int64_t>());
      case at::kComplexDouble: {
        auto c = t.item<c10::complex<double>>();
        return py::reinterpret_steal<py::object>(PyComplex_FromDoubles(c.real(), c.imag()));
      }
      default: return py::float_(t.item<double>());
    }
  }

  // Everything but a hit: the Python kernel, then (for a key built here) the executable it keeps.
  void call_python(const c10::OperatorHandle& op, Stack* stack, size_t base, const Key* key) {
    const size_t n = kinds.size();
    py::gil_scoped_acquire gil;
    py::tuple args(count_positional());
    py::dict kwargs;
    size_t p = 0;
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      py::object o = to_python(v, op.schema().arguments()[i].real_type());
      if (kwarg_only[i]) kwargs[py::str(names[i])] = o;
      else args[p++] = o;
    }
    if (key != nullptr && g_from_native != nullptr) {
      // With fusion on, a call fusion queues goes to the native queue from its first hit on (the Python
      // kernel would queue it in Python's, splitting groups where the two queues hand over).
      std::shared_ptr<Entry> e = learn(*key, args, kwargs, true);
      if (e && enqueue(op, e, stack, base)) return;
    }
    py::object out = py::reinterpret_steal<py::object>(PyObject_Call(kernel, args.ptr(), kwargs.ptr()));
    if (!out) throw python_error();
    if (key != nullptr) learn(*key, args, kwargs);
    const auto& returns = op.schema().returns();
    torch::jit::drop(*stack, n);
    if (returns.size() == 1) {
      push_return(stack, out, returns[0].type());
    } else if (returns.size() > 1) {
      py::tuple t = py::reinterpret_borrow<py::tuple>(out);
      for (size_t i = 0; i < returns.size(); ++i) push_return(stack, t[i], returns[i].type());
    }
  }

  // An argument as the Python kernel receives it from PyTorch (dtype, layout and memory format are
  // ints on the stack; a wrapped number is the Python number it was).
  static py::object to_python(const c10::IValue& v, const c10::TypePtr& type) {
    if (v.isNone()) return py::none();
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
      return number(v.toTensor());
    }
    c10::TypeKind kind = type->kind();
    if (auto opt = type->cast<c10::OptionalType>()) kind = opt->getElementType()->kind();
    if (kind == c10::TypeKind::ScalarTypeType) {
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    }
    if (kind == c10::TypeKind::LayoutType) {
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
    }
    if (kind == c10::TypeKind::MemoryFormatType) {
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
    }
    return torch::jit::toPyObject(v);
  }

  static void push_return(Stack* stack, py::handle o, const c10::TypePtr& type) {
    if (o.is_none() && type->kind() == c10::TypeKind::TensorType) stack->emplace_back(at::Tensor());
    else stack->push_back(torch::jit::toIValue(o, type));
  }

  size_t count_positional() const {
    size_t c = 0;
    for (bool k : kwarg_only) c += !k;
    return c;
  }

  // Ask the Python kernel's lookup for this key's executable and remember it; `queue_only`: only if
  // fusion queues these calls natively. Returns the entry remembered, if any.
  std::shared_ptr<Entry> learn(const Key& key, const py::tuple& args, const py::dict& kwargs,
                               bool queue_only = false) {
    py::object exe = py::reinterpret_steal<py::object>(PyObject_Call(lookup, args.ptr(), kwargs.ptr()));
    if (!exe) {
      PyErr_Clear();
      return nullptr;
    }
    auto e = std::make_shared<Entry>();
    if (PyTuple_Check(exe.ptr())) {  // (executable, whether fusion queues this call, info, key, outputs)
      auto t = exe.cast<py::tuple>();
      e->python_only = t[1].cast<bool>();
      if (e->python_only && t.size() >= 5 && !t[0].is_none() && g_from_native != nullptr) {
        e->queue = true;
        e->python_only = false;
        e->pyinfo = py::object(t[2]).release().ptr();
        e->pykey = py::object(t[3]).release().ptr();
        if (!t[4].is_none()) {
          for (py::handle m : t[4]) {
            auto mt = m.cast<py::tuple>();
            e->outmeta.emplace_back(mt[0].cast<std::vector<int64_t>>(), mt[1].cast<std::vector<int64_t>>(),
                                    reinterpret_cast<THPDtype*>(mt[2].ptr())->scalar_type);
          }
        }
      }
      exe = t[0];
    }
    if (several_mutated && !(!exe.is_none() && py::hasattr(exe, "__neuron_inplace__"))) {
      e->python_only = true;  // results to copy into several arguments: the Python kernel does that
      e->queue = false;
    }
    if (mutated >= 0 && kinds[mutated] == OUT && e->queue) {  // fusion does not queue out= calls here
      e->queue = false;
      e->python_only = true;
    }
    if (queue_only && !e->queue) return nullptr;
    if (e->python_only || exe.is_none()) {
      e->python_only = true;
    } else {
      py::object aten = py::getattr(exe, "__neuron_aten__", py::none());
      if (!aten.is_none()) {
        auto name = op_name(aten.cast<std::string>());
        auto dot = name.find('.');
        auto handle = c10::Dispatcher::singleton().findSchema(
            {"aten::" + name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1)});
        if (!handle) return nullptr;
        e->aten = *handle;
      }
      if (!e->aten) e->aoti.read(exe);
      e->inplace = py::hasattr(exe, "__neuron_inplace__");
      e->label = read_label(exe);
      e->exe = exe.release().ptr();
    }
    std::lock_guard<neuron_memory::SpinLock> lock(mu);
    int64_t g = g_generation.load();
    if (generation != g) {
      table.clear();
      generation = g;
    }
    return table.emplace(key, std::move(e)).first->second;
  }
};

// ---------------------------------------------------------------------------------------------------
// Typed kernels: the hit path of the hottest functional ops, called with the op's C++ arguments. A boxed
// kernel's stack holds a reference to each tensor, and the first reference C++ takes to a tensor Python
// owns costs a GIL round trip (PyObject preservation), on every call; here nothing is boxed. The key is
// the one OpState builds from the stack (each argument goes through the IValue boxing would make of it,
// tensors excepted), so both kernels share one table. A miss, or an entry this path does not run (the
// Python slow path's, fusion's, a flush owed first), boxes the arguments and calls OpState.
// ---------------------------------------------------------------------------------------------------
std::atomic<int64_t> g_typed_executions{0};  // the hits of `executions` typed kernels served

template <class Op, class Sig = typename Op::schema>
struct Typed;

template <class Op, class... Args>
struct Typed<Op, at::Tensor(Args...)> final : c10::OperatorKernel {
  std::unique_ptr<OpState> st;
  c10::OperatorHandle op;

  Typed(std::unique_ptr<OpState> s, c10::OperatorHandle h) : st(std::move(s)), op(std::move(h)) {}

  at::Tensor operator()(c10::DispatchKeySet ks, Args... args) {
    // One key buffer per thread: nothing between building the key and the lookup calls another kernel.
    thread_local Key key;
    key.clear();
    size_t i = 0;
    if ((word(i++, args, key) && ...)) {
      std::shared_ptr<Entry> e = st->find(key);
      if (e && !e->queue && !e->python_only && !g_pending.load(std::memory_order_relaxed)) {
        at::Tensor out;
        const bool traced = neuron_trace::on();  // a profiler records device activity (trace.h)
        const int64_t t0 = C10_UNLIKELY(traced) ? neuron_trace::now() : 0;
        if (run(*e, out, args...)) {
          g_executions.fetch_add(1, std::memory_order_relaxed);
          g_typed_executions.fetch_add(1, std::memory_order_relaxed);
          if (C10_UNLIKELY(traced)) neuron_trace::record(e->label, neuron_trace::OPS, t0);
          return out;
        }
      }
    }
    Stack stack;
    stack.reserve(sizeof...(Args));
    (stack.emplace_back(args), ...);
    (*st)(op, ks, &stack);
    return std::move(stack.back()).toTensor();
  }

  bool word(size_t i, const at::Tensor& t, Key& key) const { return OpState::tensor_arg(st->kinds[i], t, key); }
  bool word(size_t i, const std::optional<at::Tensor>& t, Key& key) const {
    return OpState::tensor_arg(st->kinds[i], t.has_value() ? *t : at::Tensor(), key);
  }
  template <class T>
  bool word(size_t i, const T& v, Key& key) const { return st->arg_words(i, c10::IValue(v), key); }

  // What the kernel takes for each argument: a neuron tensor's CPU view; anything else as it is.
  static at::Tensor host(const at::Tensor& t) {
    return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number() ? cpu_view(t) : t;
  }
  static std::optional<at::Tensor> host(const std::optional<at::Tensor>& t) {
    return t.has_value() ? std::optional<at::Tensor>(host(*t)) : std::nullopt;
  }
  template <class T>
  static const T& host(const T& v) { return v; }

  // An aoti executable's inputs, in OpState::run's order: the tensors, then the run-time Scalars.
  using Scalars = c10::SmallVector<c10::IValue, 2>;
  void gather(size_t i, const at::Tensor& t, std::vector<at::Tensor>& in, Scalars&) const {
    if (t.defined()) in.push_back(host(t));
  }
  void gather(size_t i, const std::optional<at::Tensor>& t, std::vector<at::Tensor>& in, Scalars& sc) const {
    if (t.has_value()) gather(i, *t, in, sc);
  }
  template <class T>
  void gather(size_t i, const T& v, std::vector<at::Tensor>&, Scalars& sc) const {
    if (st->kinds[i] != SCALAR) return;
    c10::IValue iv(v);
    if (!iv.isNone()) sc.push_back(std::move(iv));
  }

  bool run(const Entry& e, at::Tensor& out, const Args&... args) const {
    try {
      if (e.aten) {
        if (!(*e.aten == op)) return false;  // the executable runs another op: OpState's path does that
        out = op.typed<at::Tensor(Args...)>().redispatch(kCpuKeys, host(args)...);
      } else if (e.aoti.runner != nullptr) {
        LaunchBuffers buffers;
        std::vector<at::Tensor>& in = buffers.in;
        std::vector<at::Tensor>& outs = buffers.outs;
        c10::SmallVector<c10::IValue, 2> scalars;
        in.reserve(sizeof...(Args));
        size_t i = 0;
        (gather(i++, args, in, scalars), ...);
        if (!e.aoti.run_into(in, scalars, outs) || outs.empty()) return false;
        out = std::move(outs[0]);
      } else {
        return false;
      }
    } catch (const std::exception&) {
      return false;
    }
    if (!out.defined()) return false;
    out = to_neuron_fresh(std::move(out));
    return true;
  }
};

// The ops served typed (functional, one tensor returned; C++ signatures without SymInt).
#define NEURON_TYPED_OPS(X)                                                                              \
  X(add_Tensor) X(sub_Tensor) X(mul_Tensor) X(div_Tensor) X(add_Scalar) X(mul_Scalar) X(div_Scalar)        \
  X(mm) X(bmm) X(addmm) X(gelu) X(gelu_backward) X(relu) X(threshold_backward) X(silu) X(silu_backward)   \
  X(sigmoid) X(sigmoid_backward) X(tanh) X(tanh_backward) X(exp) X(neg) X(sqrt) X(rsqrt)                 \
  X(pow_Tensor_Scalar) X(mse_loss) X(mse_loss_backward) X(sum_dim_IntList) X(mean_dim) X(_softmax)        \
  X(_softmax_backward_data) X(_log_softmax) X(_log_softmax_backward_data) X(where_self) X(maximum)

using TypedRegistrar = bool (*)(std::unique_ptr<OpState>&);

template <class Op>
bool register_typed(std::unique_ptr<OpState>& st) {
  using Sig = typename Op::schema;
  if (st->kinds.size() != c10::guts::infer_function_traits_t<Sig>::number_of_parameters) return false;
  auto handle = c10::Dispatcher::singleton().findSchema({Op::name, Op::overload_name});
  if (!handle) return false;
  // Kept for the process, as torch::Library registrations are (nothing unregisters a compute kernel).
  static auto* keep = new std::vector<c10::RegistrationHandleRAII>();
  auto kernel = std::make_unique<Typed<Op>>(std::move(st), *handle);
  keep->push_back(c10::Dispatcher::singleton().registerImpl(
      handle->operator_name(), c10::DispatchKey::PrivateUse1,
      c10::KernelFunction::makeFromUnboxedFunctor<false, Typed<Op>>(std::move(kernel)),
      c10::impl::CppSignature::make<Sig>(), nullptr, "neuron-runtime typed hit path"));
  return true;
}

const std::unordered_map<std::string, TypedRegistrar>& typed_ops() {
  static const auto* ops = [] {
    auto* m = new std::unordered_map<std::string, TypedRegistrar>();
#define NEURON_TYPED_ENTRY(op)                                                                            \
  m->emplace(std::string(at::_ops::op::name) +                                                            \
                 (std::string(at::_ops::op::overload_name).empty() ? "" : "." + std::string(at::_ops::op::overload_name)), \
             &register_typed<at::_ops::op>);
    NEURON_TYPED_OPS(NEURON_TYPED_ENTRY)
#undef NEURON_TYPED_ENTRY
    return m;
  }();
  return *ops;
}

// An executable's tensor arguments for a Python call (`exe(tensors, scalars)`): host tensors as they
// are, wrapped numbers as the Python numbers they were.
py::list host_list(const std::vector<at::Tensor>& ts) {
  py::list out;
  for (const at::Tensor& t : ts) {
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) out.append(OpState::number(t));
    else out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  }
  return out;
}

// Run the native queue (fusion.flush calls this when its marker is queued; the GIL is held).
// `into[k]`: the input the executable writes live result k into, or -1 where it returns it (see
// fusion._into, whose rule run_queue applies).
bool run_group(GroupExe& g, const std::vector<QNode>& nodes, const std::vector<at::Tensor>& ext,
               const std::vector<std::pair<int64_t, int64_t>>& live, const std::vector<int64_t>& into) {
  std::vector<at::Tensor> outs;
  try {
    if (g.aoti.runner != nullptr) {
      std::vector<c10::IValue> scalars;
      for (const QNode& node : nodes) scalars.insert(scalars.end(), node.scalars.begin(), node.scalars.end());
      if (!g.aoti.run(ext, scalars, outs)) return false;
    } else {
      py::list tensors = host_list(ext), scalars;
      for (const QNode& node : nodes) {
        for (const c10::IValue& v : node.scalars) scalars.append(torch::jit::toPyObject(v));
      }
      if (!call_exe(g.exe, tensors, scalars, outs)) return false;
      for (const at::Tensor& o : outs) {
        if (!o.defined()) return false;  // every output of a group is one to write back
      }
    }
    size_t n = 0;
    for (int64_t e : into) n += e < 0 ? 1 : 0;
    if (outs.size() != n) return false;
    for (size_t k = 0, o = 0; k < live.size(); ++k) {
      if (into[k] < 0) nodes[live[k].first].dsts[live[k].second].copy_(outs[o++]);
    }
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

// A group Python decided runs op by op (fusion._flush_from_native returned False: a lone op, or a group
// that could not compile or ran slower fused): each queued op's own executable in queue order, its results
// copied into its outputs, as fusion._run_each does, without a Python call per group. A slot wired to an
// earlier op reads that op's output buffer, filled by then; a view slot reads its CPU view on it.
void run_each(const std::vector<QNode>& nodes) {
  const bool traced = neuron_trace::on();
  for (const QNode& node : nodes) {
    std::vector<at::Tensor> in;
    in.reserve(node.ins.size());
    for (size_t k = 0; k < node.ins.size(); ++k) {
      const auto& [j, i] = node.wire[k];
      in.push_back(j >= 0 && node.view[k].empty() ? nodes[j].dsts[i] : node.cpu[k]);
    }
    const Entry& e = *node.e;
    const int64_t t0 = traced ? neuron_trace::now() : 0;
    std::vector<at::Tensor> outs;
    if (e.aoti.runner == nullptr || !e.aoti.run(in, node.scalars, outs)) {
      outs.clear();
      py::list tensors = host_list(in), scalars;
      for (const c10::IValue& v : node.scalars) scalars.append(torch::jit::toPyObject(v));
      py::object r = py::reinterpret_steal<py::object>(
          PyObject_CallFunctionObjArgs(e.exe, tensors.ptr(), scalars.ptr(), nullptr));
      if (!r) throw python_error();
      for (py::handle o : r) outs.push_back(o.is_none() ? at::Tensor() : THPVariable_Unpack(o.ptr()));
    }
    if (traced) neuron_trace::record(e.label, neuron_trace::OPS, t0);
    for (size_t i = 0; i < node.dsts.size() && i < outs.size(); ++i) node.dsts[i].copy_(outs[i]);
  }
  g_q_run_each.fetch_add(static_cast<int64_t>(nodes.size()), std::memory_order_relaxed);
}

std::shared_ptr<GroupExe> group_exe(py::handle exe) {
  auto g = std::make_shared<GroupExe>();
  g->aoti.read(exe);
  g->label = read_label(exe);
  g->exe = exe.inc_ref().ptr();
  return g;
}

// ---------------------------------------------------------------------------------------------------
// torch.compile graphs (neuron_runtime/graphs/_compile.py, `GraphPlan`): a graph's executable called with one
// Python call instead of a CPU view and a relabel in Python per tensor (about 40 us a call for the MLP's
// forward graph). `inputs[i]`: the placeholder feeding executable input i, or -(k + 1) for the graph's
// constant tensor `consts[k]` (a neuron tensor goes in as its CPU view, a CPU tensor as it is);
// `copies`: (placeholder, executable output) pairs, the input mutations copied back into the inputs'
// memory; `writes`: the placeholders the executable wrote in place itself (the graph's `into`); each
// mutated input's version counter is bumped as the in-place op would; `outputs`: per graph output,
// (0, v) the executable's output v, (1, p) placeholder p itself, (2, _) None; `on_device[v]`: whether
// executable output v becomes a neuron tensor (else it stays on CPU, where AOTAutograd placed it).
// Called with the GIL; the executable runs without it.
// ---------------------------------------------------------------------------------------------------
struct GraphRunner {
  AotiCall aoti;
  py::object exe;
  std::vector<int64_t> inputs;
  std::vector<std::pair<int64_t, int64_t>> copies;
  std::vector<int64_t> writes;
  std::vector<std::pair<int, int64_t>> outputs;
  std::vector<bool> on_device;
  std::vector<at::Tensor> consts;
  std::shared_ptr<const neuron_trace::Label> label;

  GraphRunner(py::object e, std::vector<int64_t> in, std::vector<std::pair<int64_t, int64_t>> cp,
              std::vector<int64_t> wr, std::vector<std::pair<int, int64_t>> out, std::vector<bool> dev,
              std::vector<at::Tensor> c)
      : exe(std::move(e)), inputs(std::move(in)), copies(std::move(cp)), writes(std::move(wr)),
        outputs(std::move(out)), on_device(std::move(dev)), consts(std::move(c)) {
    aoti.read(exe);
    label = read_label(exe);
  }

  static at::Tensor arg(const py::list& args, int64_t p) {
    PyObject* o = PyList_GetItem(args.ptr(), p);  // borrowed
    if (o == nullptr) throw python_error();
    if (!THPVariable_Check(o)) throw std::invalid_argument("a torch.compile graph input is not a tensor");
    return THPVariable_Unpack(o);
  }

  // The graph's outputs, or None when this runner cannot make the call (the caller's Python path does).
  py::object call(const py::list& args) {
    if (g_pending.load()) flush_queued("torch.compile graph");
    std::vector<at::Tensor> in;
    in.reserve(inputs.size());
    for (int64_t p : inputs) {
      at::Tensor t = p >= 0 ? arg(args, p) : consts.at(static_cast<size_t>(-1 - p));
      in.push_back(t.device().type() == c10::DeviceType::PrivateUse1 ? cpu_view(t) : std::move(t));
    }
    std::vector<at::Tensor> outs;
    const bool traced = neuron_trace::on();
    const int64_t t0 = traced ? neuron_trace::now() : 0;
    if (aoti.runner != nullptr) {
      py::gil_scoped_release nogil;
      if (!aoti.run(std::move(in), {}, outs)) return py::none();
    } else {
      py::list tensors, scalars;
      for (at::Tensor& t : in) tensors.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))));
      if (!call_exe(exe.ptr(), tensors, scalars, outs)) return py::none();
    }
    if (traced) neuron_trace::record(label, neuron_trace::GRAPHS, t0);
    for (const auto& [p, i] : copies) {
      if (i < 0 || static_cast<size_t>(i) >= outs.size()) return py::none();
    }
    for (int64_t p : writes) arg(args, p).unsafeGetTensorImpl()->bump_version();
    for (const auto& [p, i] : copies) {
      at::Tensor t = arg(args, p);
      if (t.device().type() == c10::DeviceType::PrivateUse1) {
        cpu_view(t).copy_(outs[i]);
        t.unsafeGetTensorImpl()->bump_version();
      } else {
        t.copy_(outs[i]);
      }
    }
    std::vector<py::object> made(outs.size());  // a result returned twice is one tensor, as in the graph
    py::list result(outputs.size());
    for (size_t k = 0; k < outputs.size(); ++k) {
      const auto& [kind, v] = outputs[k];
      py::object o;
      if (kind == 0) {
        if (v < 0 || static_cast<size_t>(v) >= outs.size()) throw std::out_of_range("graph output index");
        if (!made[v]) {
          at::Tensor x = std::move(outs[v]);
          if (on_device[v]) x = to_neuron_fresh(std::move(x));
          made[v] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(x)));
        }
        o = made[v];
      } else if (kind == 1) {
        o = py::reinterpret_borrow<py::object>(PyList_GetItem(args.ptr(), v));
      } else {
        o = py::none();
      }
      PyList_SET_ITEM(result.ptr(), k, o.release().ptr());
    }
    if (PyList_SetSlice(args.ptr(), 0, PyList_GET_SIZE(args.ptr()), nullptr) != 0) throw python_error();
    return std::move(result);
  }
};

// ---------------------------------------------------------------------------------------------------
// A `neuron_runtime.kernel` call that autograd records, without Python's autograd.Function around it
// (kernels/_kernel.py, `_Launch.autograd`): the forward graph (`fwd`, a GraphRunner) runs on the call's
// tensors; its first `n_out` outputs are the call's results, the rest are saved for the backward with the
// tensors. Its node runs the backward graph (`bwd`) on (gradients, tensors, saved outputs) when each
// gradient has the dtype, sizes and strides `bwd` was made for (`want`: those of the backward Python ran
// first), else Python's `fallback(*gradients, *tensors, *saved outputs)`, which finds the launch of the
// gradients' own key; either returns one gradient per tensor of `edges` (the differentiable ones, by
// index). Created once per forward launch; called with the GIL. The Python objects it
// holds are released under the GIL (a node may die on any thread).
// `try_call(*args)` is the kernel object's whole eager call for the arguments of this launch's key
// (`args_like`: tensors by dtype, sizes and strides; other arguments by type and value), when nothing
// watches or transforms it (`_plain`'s conditions) and autograd records it; None otherwise.
// ---------------------------------------------------------------------------------------------------
std::atomic<int64_t> g_graph_runs{0};  // graphs these calls ran (stats()["graphs"]["graph_executions"])
std::atomic<int64_t> g_runtime{0};     // bumped by a new runtime (`forget_kernels`): older calls decline

struct GradMeta {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  bool fits(const at::Tensor& g) const {
    return g.scalar_type() == dtype && g.sizes().equals(sizes) && g.strides().equals(strides) &&
           g.device().type() == c10::DeviceType::PrivateUse1;
  }
};

struct KernelAutograd : std::enable_shared_from_this<KernelAutograd> {
  std::string name;
  py::object fwd, bwd, fallback;
  size_t n_out;
  std::vector<GradMeta> want;
  std::vector<size_t> edges;
  struct Arg {
    bool tensor;
    GradMeta meta;     // a tensor's
    py::object value;  // anything else's
  };
  std::vector<Arg> key;
  size_t n_tensors = 0;  // of `key`
  int64_t runtime = g_runtime.load();

  KernelAutograd(std::string nm, py::object f, size_t n, py::object b, const py::list& w, py::object fb,
                 std::vector<size_t> e, const py::list& args_like)
      : name(std::move(nm)), fwd(std::move(f)), bwd(std::move(b)), fallback(std::move(fb)), n_out(n),
        edges(std::move(e)) {
    for (py::handle a : args_like) {
      if (THPVariable_Check(a.ptr())) {
        const at::Tensor& t = THPVariable_Unpack(a.ptr());
        key.push_back({true, {t.scalar_type(), t.sizes().vec(), t.strides().vec()}, py::object()});
        ++n_tensors;
      } else {
        key.push_back({false, {}, py::reinterpret_borrow<py::object>(a)});
      }
    }
    for (py::handle m : w) {  // (dtype, sizes, strides)
      auto t = m.cast<py::tuple>();
      want.push_back({reinterpret_cast<THPDtype*>(t[0].ptr())->scalar_type, t[1].cast<std::vector<int64_t>>(),
                      t[2].cast<std::vector<int64_t>>()});
    }
    if (want.size() != n_out) throw std::invalid_argument("KernelAutograd: one gradient per result");
  }
  ~KernelAutograd() {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      fwd = py::object(), bwd = py::object(), fallback = py::object();
      for (Arg& a : key) a.value = py::object();
    }
  }

  py::object call(const py::tuple& args);

  py::object try_call(const py::args& args) {
    if (args.size() != key.size() || !at::GradMode::is_enabled() ||
        C10_UNLIKELY(torch::profiler::impl::profilerEnabled() || at::impl::torch_function_mode_enabled() ||
                     c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
                     c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))) {
      return py::none();
    }
    py::tuple tensors(n_tensors);
    bool grad = false;
    size_t j = 0;
    for (size_t i = 0; i < key.size(); ++i) {
      PyObject* a = PyTuple_GET_ITEM(args.ptr(), i);
      if (!key[i].tensor) {  // a constant of the traced graph: the same type and value
        if (Py_TYPE(a) != Py_TYPE(key[i].value.ptr())) return py::none();
        int eq = PyObject_RichCompareBool(a, key[i].value.ptr(), Py_EQ);
        if (eq != 1) {
          if (eq < 0) PyErr_Clear();
          return py::none();
        }
        continue;
      }
      if (!THPVariable_CheckExact(a)) return py::none();  // (a Tensor or a Parameter, no subclass)
      const at::Tensor& t = THPVariable_Unpack(a);
      if (!key[i].meta.fits(t)) return py::none();
      grad = grad || t.requires_grad();
      PyTuple_SET_ITEM(tensors.ptr(), j++, py::reinterpret_borrow<py::object>(a).release().ptr());
    }
    if (!grad) return py::none();
    return call(tensors);
  }
};

struct KernelBackward final : torch::autograd::Node {
  std::shared_ptr<KernelAutograd> how;
  std::vector<torch::autograd::SavedVariable> saved;  // the arguments, then the saved outputs

  std::string name() const override { return how->name + "Backward"; }
  void release_variables() override {
    for (auto& s : saved) s.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const KernelAutograd& k = *how;
    std::vector<at::Tensor> ins;
    ins.reserve(grads.size() + saved.size());
    bool fits = true;
    for (size_t i = 0; i < grads.size(); ++i) {  // (one per result: the node's inputs are `want`'s)
      at::Tensor g = grads[i];
      if (!g.defined()) {  // a result nobody used: its gradient is zeros
        g = at::zeros(k.want[i].sizes, at::TensorOptions().dtype(k.want[i].dtype).device(kNeuron));
      }
      fits = fits && k.want[i].fits(g);
      ins.push_back(std::move(g));
    }
    for (const auto& s : saved) ins.push_back(s.unpack());
    py::gil_scoped_acquire gil;
    auto wrap = [&]() {
      py::list l;
      for (const at::Tensor& t : ins) l.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
      return l;
    };
    py::object out = py::none();
    if (fits) {
      out = k.bwd.cast<GraphRunner&>().call(wrap());
      if (!out.is_none()) {
        g_executions.fetch_add(1, std::memory_order_relaxed);
        g_graph_runs.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (out.is_none()) out = k.fallback(*wrap());
    torch::autograd::variable_list result;
    for (py::handle o : out) result.push_back(o.is_none() ? at::Tensor() : THPVariable_Unpack(o.ptr()));
    if (result.size() != num_outputs()) {
      throw std::runtime_error(how->name + ": its backward returned " + std::to_string(result.size()) +
                               " gradients for " + std::to_string(num_outputs()) + " inputs");
    }
    return result;
  }
};

py::object KernelAutograd::call(const py::tuple& args) {
  if (runtime != g_runtime.load()) return py::none();  // made with another runtime's executables
  py::list in;
  std::vector<at::Tensor> inputs;
  inputs.reserve(args.size());
  for (py::handle a : args) {
    if (!THPVariable_Check(a.ptr())) throw std::invalid_argument("KernelAutograd: arguments are tensors");
    inputs.push_back(THPVariable_Unpack(a.ptr()));
    in.append(a);
  }
  if (g_pending.load()) flush_queued(("kernel:" + name).c_str());  // a fusion region ends at a kernel
  py::object out = fwd.cast<GraphRunner&>().call(in);
  if (out.is_none()) return out;  // the runner cannot make this call: Python's route does
  g_executions.fetch_add(1, std::memory_order_relaxed);
  g_graph_runs.fetch_add(1, std::memory_order_relaxed);
  py::list outs = out.cast<py::list>();
  if (outs.size() < n_out) throw std::runtime_error(name + ": its forward returned too few outputs");
  auto node = c10::make_intrusive<KernelBackward>();
  node->how = shared_from_this();
  std::vector<at::Tensor> differentiable;
  for (size_t i : edges) differentiable.push_back(inputs.at(i));
  node->set_next_edges(torch::autograd::collect_next_edges(differentiable));
  for (const at::Tensor& t : inputs) node->saved.emplace_back(t, false);
  for (size_t i = n_out; i < outs.size(); ++i) node->saved.emplace_back(THPVariable_Unpack(outs[i].ptr()), false);
  for (size_t i = 0; i < n_out; ++i) {
    const at::Tensor& t = THPVariable_Unpack(outs[i].ptr());
    if (torch::autograd::isDifferentiableType(t.scalar_type())) torch::autograd::set_history(t, c10::intrusive_ptr<torch::autograd::Node>(node));
    else node->add_input_metadata(torch::autograd::Node::undefined_input());
  }
  if (n_out == 1) return outs[0];
  py::tuple r(n_out);
  for (size_t i = 0; i < n_out; ++i) r[i] = outs[i];
  return std::move(r);
}

void run_queue() {
  std::vector<QNode> nodes;
  nodes.swap(g_queue);
  g_writer.clear();
  g_written.clear();
  g_fresh_writer.clear();
  g_views.clear();
  if (nodes.empty()) return;
  // Wiring, as fusion.py's flush builds it: each tensor slot reads the group's input `ext[i]` or the
  // result of the last queued op that wrote that tensor.
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, int64_t>> writer;
  std::unordered_map<const c10::TensorImpl*, int64_t> ext_index;
  std::vector<at::Tensor> ext;
  Key words;
  for (size_t j = 0; j < nodes.size(); ++j) {
    const QNode& node = nodes[j];
    words.push_back(reinterpret_cast<int64_t>(node.op));
    words.push_back(reinterpret_cast<int64_t>(node.e.get()));
    words.push_back(static_cast<int64_t>(node.ins.size()));
    for (size_t k = 0; k < node.ins.size(); ++k) {
      if (node.wire[k].first >= 0) {
        words.push_back(T_TENSOR);
        words.push_back(node.wire[k].first);
        words.push_back(node.wire[k].second);
        words.push_back(static_cast<int64_t>(node.view[k].size()));
        words.insert(words.end(), node.view[k].begin(), node.view[k].end());
        continue;
      }
      const at::Tensor& t = node.ins[k];
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      auto x = impl->is_wrapped_number() ? ext_index.end() : ext_index.find(impl);
      int64_t idx;
      if (x != ext_index.end()) {
        idx = x->second;
      } else {
        idx = static_cast<int64_t>(ext.size());
        ext.push_back(node.cpu[k]);  // CPU views (and wrapped numbers)
        if (!impl->is_wrapped_number()) ext_index[impl] = idx;
      }
      words.push_back(impl->is_wrapped_number() ? T_WRAPPED : T_NONE);
      words.push_back(idx);
    }
    for (size_t i = 0; i < node.ids.size(); ++i) {
      writer[node.ids[i]._unsafe_get_target()] = {static_cast<int64_t>(j), static_cast<int64_t>(i)};
    }
  }
  // What to write back: each tensor's last writer, if it can still be read (see fusion.py): a fresh
  // buffer is, while anything but the queue's own slots holds it (its neuron tensor's storage does).
  std::vector<std::pair<int64_t, int64_t>> live;
  size_t n_dsts = 0;
  std::unordered_map<const c10::TensorImpl*, size_t> slots;
  for (const QNode& node : nodes) {
    n_dsts += node.dsts.size();
    for (const at::Tensor& d : node.dsts) ++slots[d.unsafeGetTensorImpl()];
  }
  for (const auto& [impl, w] : writer) {
    const at::Tensor& d = nodes[w.first].dsts[w.second];
    if (!nodes[w.first].fresh[w.second] || d.use_count() > slots[d.unsafeGetTensorImpl()]) live.push_back(w);
  }
  std::sort(live.begin(), live.end());
  // Which live results the executable writes into an input (fusion._into): an in-place op's target the
  // group also reads as input, when no other input shares its memory.
  std::unordered_map<const void*, int> storages;
  for (const at::Tensor& t : ext) {
    if (!t.unsafeGetTensorImpl()->is_wrapped_number()) ++storages[storage_ptr(t)];
  }
  std::vector<int64_t> into;
  words.push_back(T_LIST);
  for (const auto& [j, i] : live) {
    int64_t e = -1;
    if (nodes[j].inplace) {
      auto x = ext_index.find(nodes[j].ids[i]._unsafe_get_target());
      if (x != ext_index.end() && storages[storage_ptr(ext[x->second])] == 1) e = x->second;
    }
    into.push_back(e);
    words.push_back(j);
    words.push_back(i);
    words.push_back(e);
  }
  if (g_groups_generation != g_generation.load()) {
    g_groups.clear();
    g_groups_generation = g_generation.load();
  }
  {
    auto it = g_groups.find(words);
    if (it != g_groups.end() && it->second->each) {
      const int64_t at = it->second->recheck_at;
      if (at == 0 || std::chrono::steady_clock::now().time_since_epoch().count() < at) {
        run_each(nodes);
        return;
      }
      g_groups.erase(it);  // time to ask Python again (its executable may be in)
      it = g_groups.end();
    }
    if (it != g_groups.end()) {
      const bool traced = neuron_trace::on();
      const int64_t t0 = traced ? neuron_trace::now() : 0;
      if (run_group(*it->second, nodes, ext, live, into)) {
        if (traced) neuron_trace::record(it->second->label, neuron_trace::FUSED, t0);
        g_q_fused_runs.fetch_add(1, std::memory_order_relaxed);
        g_q_ops_fused.fetch_add(static_cast<int64_t>(nodes.size()), std::memory_order_relaxed);
        g_q_not_materialised.fetch_add(static_cast<int64_t>(n_dsts - live.size()), std::memory_order_relaxed);
        return;
      }
      g_groups.erase(it);  // it failed: Python decides (and remembers a group that cannot run fused)
    }
  }
  // Python decides (and runs) everything else. One CPU tensor object per neuron tensor, so Python's
  // wiring (by object identity) sees what this one saw.
  std::unordered_map<const c10::TensorImpl*, py::object> cpu_of;
  auto host = [&](const QNode& node, size_t k) -> py::object {
    const c10::TensorImpl* impl = node.ins[k].unsafeGetTensorImpl();
    auto it = cpu_of.find(impl);
    if (it != cpu_of.end()) return it->second;
    py::object o = py::reinterpret_steal<py::object>(THPVariable_Wrap(node.cpu[k]));
    cpu_of.emplace(impl, o);
    return o;
  };
  py::list pynodes;
  for (const QNode& node : nodes) {
    py::list ins, scalars, dsts;
    for (size_t k = 0; k < node.ins.size(); ++k) {
      const at::Tensor& t = node.ins[k];
      if (!node.view[k].empty()) {  // fusion.py sees the view's CPU tensor, on its writer's buffer
        ins.append(host(node, k));
      } else if (node.wire[k].first >= 0) {
        const QNode& w = nodes[node.wire[k].first];
        ins.append(cpu_of.at(w.ids[node.wire[k].second]._unsafe_get_target()));
      } else {
        ins.append(t.unsafeGetTensorImpl()->is_wrapped_number() ? OpState::number(t) : host(node, k));
      }
    }
    for (const c10::IValue& v : node.scalars) scalars.append(torch::jit::toPyObject(v));
    for (size_t i = 0; i < node.dsts.size(); ++i) {
      const c10::TensorImpl* impl = node.ids[i]._unsafe_get_target();
      auto it = cpu_of.find(impl);
      if (node.inplace && it != cpu_of.end()) {
        dsts.append(it->second);
      } else {
        py::object o = py::reinterpret_steal<py::object>(THPVariable_Wrap(node.dsts[i]));
        cpu_of[impl] = o;
        dsts.append(o);
      }
    }
    pynodes.append(py::make_tuple(py::handle(node.e->pyinfo), py::handle(node.e->pykey),
                                  py::handle(node.e->exe), ins, scalars, dsts, node.inplace));
  }
  py::list pylive;
  for (const auto& [j, i] : live) pylive.append(py::make_tuple(j, i));
  py::object r = py::reinterpret_steal<py::object>(
      PyObject_CallFunctionObjArgs(g_from_native, pynodes.ptr(), pylive.ptr(), nullptr));
  if (!r) throw python_error();
  if (r.ptr() == Py_False || (PyLong_CheckExact(r.ptr()) && PyLong_AsLongLong(r.ptr()) > 0)) {
    auto g = std::make_shared<GroupExe>();  // op by op: for good, or for the milliseconds Python said
    g->each = true;
    if (r.ptr() != Py_False) {
      g->recheck_at = std::chrono::steady_clock::now().time_since_epoch().count() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::milliseconds(PyLong_AsLongLong(r.ptr()))).count();
    }
    g_groups[words] = std::move(g);
  } else if (!r.is_none() && nodes.size() > 1) {
    g_groups[words] = group_exe(r);
  }
}

void set_fusion(py::object flush, py::object started, py::object from_native, size_t limit) {
  g_queue.clear();
  g_writer.clear();
  g_written.clear();
  g_fresh_writer.clear();
  g_views.clear();
  g_groups.clear();
  for (auto [slot, obj] : {std::pair<PyObject**, py::object*>{&g_flush, &flush}, {&g_started, &started},
                           {&g_from_native, &from_native}}) {
    PyObject* old = *slot;
    *slot = obj->is_none() ? nullptr : obj->inc_ref().ptr();
    Py_XDECREF(old);
  }
  g_limit = std::max<size_t>(1, limit);
  g_pending.store(false);
}

py::dict fusion_counters() {
  py::dict d;
  d["ops_buffered"] = g_q_buffered.load();
  d["fused_executions"] = g_q_fused_runs.load();
  d["ops_fused"] = g_q_ops_fused.load();
  d["outputs_not_materialised"] = g_q_not_materialised.load();
  d["ops_run_each"] = g_q_run_each.load();
  return d;
}

// Allocation, copies and reads, which PyTorch reaches through `empty`, `empty_strided`, `_copy_from`
// (`clone`, `contiguous`, `reshape` of a non-contiguous tensor, `.to`) and `_local_scalar_dense`
// (`.item()`, `bool()`): the common cases here, the rest (other layouts, pinned memory, other device
// indices, conjugate/negative bits) by the Python kernels. HOST_FACTORY: `arange`, `full`, `scalar_tensor`
// (aten/_decomp.py `_host_factory`): CPU's factory, relabelled.
enum Special : int { EMPTY = 0, EMPTY_STRIDED = 1, COPY_FROM = 2, LOCAL_SCALAR = 3, TO_COPY = 4, HOST_FACTORY = 5,
                    CLONE = 6, SLICE_BACKWARD = 7, SELECT_BACKWARD = 8 };

struct SpecialKernel final : c10::OperatorKernel {
  Special which;
  std::unique_ptr<OpState> python;  // calls the Python kernel (its key tables stay unused)

  static bool on_neuron(const c10::IValue& device) {
    if (device.isNone()) return true;
    auto d = device.toDevice();
    return d.type() == c10::DeviceType::PrivateUse1 && (!d.has_index() || d.index() == 0);
  }

  static bool options(const Stack& stack, size_t first, at::TensorOptions& opts) {
    // dtype?, layout?, device?, pin_memory? from stack[first]
    const c10::IValue &dtype = stack[first], &layout = stack[first + 1], &device = stack[first + 2],
                      &pin = stack[first + 3];
    if (!layout.isNone() && layout.toLayout() != c10::kStrided) return false;
    if (!on_neuron(device) || (!pin.isNone() && pin.toBool())) return false;
    opts = at::TensorOptions().dtype(dtype.isNone() ? c10::get_default_dtype() : c10::scalarTypeToTypeMeta(
                                                                                      dtype.toScalarType()));
    return true;
  }

  // `kept`: the CPU view compute ops keep (`cpu_view`), for a copy's tensors, which are mostly kept ones
  // (parameters, gradients, DDP's buckets) read again and again.
  static bool host(const at::Tensor& t, at::Tensor& out, bool kept = false) {
    auto* impl = t.unsafeGetTensorImpl();
    if (impl->is_conj() || impl->is_neg() || impl->layout() != c10::kStrided) return false;
    if (impl->device_type() == c10::DeviceType::PrivateUse1) out = kept ? cpu_view(t) : to_cpu(t);
    else if (impl->device_type() == c10::DeviceType::CPU) out = t;
    else return false;
    return true;
  }

  // `host` for an argument that must be a neuron tensor (a CPU one goes to the Python kernel).
  static bool neuron_host(const c10::IValue& v, at::Tensor& out, bool kept = false) {
    return v.isTensor() && v.toTensor().device().type() == c10::DeviceType::PrivateUse1 && host(v.toTensor(), out, kept);
  }

  // Whether the op reads tensor memory (fusion's queue runs first); an allocation reads nothing.
  bool reads() const { return which != EMPTY && which != EMPTY_STRIDED && which != HOST_FACTORY; }

  bool fast(const c10::OperatorHandle& op, Stack* stack, size_t base, size_t n) {
    Stack& s = *stack;
    at::TensorOptions opts;
    if (which == HOST_FACTORY) return host_factory(op, s, base, n);
    if (which == EMPTY) {  // (size, dtype?, layout?, device?, pin_memory?, memory_format?)
      if (!s[base].isIntList() || !options(s, base + 1, opts)) return false;
      auto mf = s[base + 5].isNone() ? c10::MemoryFormat::Contiguous : s[base + 5].toMemoryFormat();
      at::Tensor out = to_neuron_fresh(at::empty(s[base].toIntVector(), opts, mf));
      torch::jit::drop(s, n);
      s.emplace_back(std::move(out));
      return true;
    }
    if (which == EMPTY_STRIDED) {  // (size, stride, dtype?, layout?, device?, pin_memory?)
      if (!s[base].isIntList() || !s[base + 1].isIntList() || !options(s, base + 2, opts)) return false;
      at::Tensor out = to_neuron_fresh(at::empty_strided(s[base].toIntVector(), s[base + 1].toIntVector(), opts));
      torch::jit::drop(s, n);
      s.emplace_back(std::move(out));
      return true;
    }
    if (which == LOCAL_SCALAR) {  // _local_scalar_dense(self) -> Scalar: `.item()`, `bool()`, printing
      at::Tensor t;
      if (!s[base].isTensor() || !host(s[base].toTensor(), t)) return false;
      c10::Scalar v = t.item();
      torch::jit::drop(s, n);
      s.emplace_back(v);
      return true;
    }
    if (which == TO_COPY) return to_copy(s, base, n);
    if (which == SLICE_BACKWARD || which == SELECT_BACKWARD) return scatter_backward(s, base, n);
    if (which == CLONE) {  // clone(self, *, memory_format?): CPU's clone of the CPU view, relabelled
      at::Tensor t;
      if (!neuron_host(s[base], t, true)) return false;
      at::Tensor out = to_neuron_fresh(at::clone(t, s[base + 1].toOptional<c10::MemoryFormat>()));
      torch::jit::drop(s, n);
      s.emplace_back(std::move(out));
      return true;
    }
    // _copy_from(self, dst, non_blocking) -> dst
    at::Tensor src, dst;
    if (!s[base].isTensor() || !s[base + 1].isTensor() || !host(s[base].toTensor(), src, true) ||
        !host(s[base + 1].toTensor(), dst, true)) {
      return false;
    }
    // CPU's copy_ judges overlap in its TensorIterator, on the tensors it copies between; the CPU views
    // here each have a storage of their own, so it is judged on the neuron tensors (`_special.copy_from`).
    at::assert_no_partial_overlap(s[base + 1].toTensor(), s[base].toTensor());
    dst.copy_(src);
    c10::IValue result = s[base + 1];
    torch::jit::drop(s, n);
    s.push_back(std::move(result));
    return true;
  }

  // slice_backward(grad, input_sizes, dim, start, end, step) / select_backward(grad, input_sizes, dim, index):
  // autograd's gradient of a slice or a select is zeros of the input's sizes with `grad` copied into the
  // slice, CPU's kernel step for step, here on the host (a fill and a copy: data movement, no compute).
  // Compiled, its key held `input_sizes`, batch size included: a training loop with a new batch size
  // compiled it again at every size (HF Llama's rotary slices: 4 executables a size).
  bool scatter_backward(Stack& s, size_t base, size_t n) {
    at::Tensor g;
    if (!neuron_host(s[base], g) || !s[base + 1].isIntList() || !s[base + 2].isInt()) return false;
    const std::vector<int64_t> sizes = s[base + 1].toIntVector();
    const int64_t nd = static_cast<int64_t>(sizes.size());
    if (nd == 0) return false;
    const int64_t dim = c10::maybe_wrap_dim(s[base + 2].toInt(), nd);
    at::Tensor out = at::zeros(sizes, g.options());
    if (which == SLICE_BACKWARD) {
      if (!s[base + 3].isInt() || !s[base + 4].isInt() || !s[base + 5].isInt()) return false;
      out.slice(dim, s[base + 3].toInt(), s[base + 4].toInt(), s[base + 5].toInt()).copy_(g);
    } else {
      if (!s[base + 3].isInt()) return false;
      out.select(dim, s[base + 3].toInt()).copy_(g);
    }
    torch::jit::drop(s, n);
    s.emplace_back(to_neuron_fresh(std::move(out)));
    return true;
  }

  // _to_copy(self, dtype?, layout?, device?, pin_memory?, non_blocking, memory_format?): `.to()` between
  // the host and neuron, or to another dtype. Neuron memory is host memory: the copy is the host's
  // `_to_copy` of the CPU view, complete on return (`non_blocking` changes nothing), relabelled for neuron.
  // Another device, a pinned or non-strided target: the Python kernel (which raises or handles it).
  bool to_copy(Stack& s, size_t base, size_t n) {
    at::Tensor src;
    if (!s[base].isTensor() || !host(s[base].toTensor(), src)) return false;
    const c10::IValue &dtype = s[base + 1], &layout = s[base + 2], &device = s[base + 3], &pin = s[base + 4],
                      &mf = s[base + 6];
    if ((!layout.isNone() && layout.toLayout() != c10::kStrided) || (!pin.isNone() && pin.toBool())) return false;
    bool to_neuron;
    if (device.isNone()) {
      to_neuron = s[base].toTensor().device().type() == c10::DeviceType::PrivateUse1;
    } else if (device.toDevice().type() == c10::DeviceType::CPU) {
      to_neuron = false;
    } else if (on_neuron(device)) {
      to_neuron = true;
    } else {
      return false;
    }
    at::Tensor out = at::_to_copy(src, dtype.toOptional<c10::ScalarType>(), std::nullopt, c10::Device(c10::kCPU),
                                  std::nullopt, false, mf.toOptional<c10::MemoryFormat>());
    torch::jit::drop(s, n);
    s.emplace_back(to_neuron ? to_neuron_fresh(std::move(out)) : std::move(out));
    return true;
  }

  // (..., dtype?, layout?, device?, pin_memory?) -> Tensor: the op's own composite with no device (so it
  // allocates and fills on the host), its result relabelled; ~1.5 us where the Python kernel took ~8.
  bool host_factory(const c10::OperatorHandle& op, Stack& s, size_t base, size_t n) {
    const size_t o = base + n - 4;
    const c10::IValue &layout = s[o + 1], &pin = s[o + 3];
    if ((!layout.isNone() && layout.toLayout() != c10::kStrided) || !on_neuron(s[o + 2]) ||
        (!pin.isNone() && pin.toBool())) {
      return false;
    }
    s[o + 2] = c10::IValue();
    op.redispatchBoxed(kCpuKeys, &s);
    s.back() = to_neuron_fresh(std::move(s.back()).toTensor());
    return true;
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, Stack* stack) {
    if (reads() && g_pending.load(std::memory_order_relaxed)) flush_queued(op);
    const size_t n = python->kinds.size();
    const size_t base = stack->size() - n;
    if (!fast(op, stack, base, n)) python->call_python(op, stack, base, nullptr);
  }
};

// A functional host op that draws random numbers (signatures/_ops.py `RANDOM`: `multinomial`,
// `native_dropout`, `bernoulli`, `normal`, ...), served without Python: the op's own CPU kernel on the
// CPU views of its neuron tensors, from the CPU generator (so `torch.manual_seed` reproduces CPU, as the
// Python kernel's host call does), its results relabelled. Anything else (a CPU tensor argument, a
// generator of another device, a conjugate view, a tensor list) goes to the Python kernel, which also
// runs every call while `set_host_native(False)` (the conformance check records host runs in Python).
std::atomic<int64_t> g_host_runs{0};
std::atomic<bool> g_host_native{true};

struct HostKernel final : c10::OperatorKernel {
  std::unique_ptr<OpState> python;  // calls the Python kernel (its key tables stay unused)

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, Stack* stack) {
    if (g_pending.load(std::memory_order_relaxed)) flush_queued(op);  // it reads its inputs
    const size_t n = python->kinds.size();
    const size_t base = stack->size() - n;
    if (!g_host_native.load(std::memory_order_relaxed) || !run(op, stack, base, n)) {
      python->call_python(op, stack, base, nullptr);
    }
  }

  bool run(const c10::OperatorHandle& op, Stack* stack, size_t base, size_t n) const {
    Stack& s = *stack;
    Stack cpu;
    cpu.reserve(n);
    bool neuron = false;
    for (size_t i = 0; i < n; ++i) {  // decided before the op runs: a draw cannot be taken back
      const c10::IValue& v = s[base + i];
      if (v.isTensor() && v.toTensor().defined()) {
        at::Tensor t;
        if (!SpecialKernel::neuron_host(v, t, true)) return false;
        cpu.emplace_back(std::move(t));
        neuron = true;
      } else if (v.isGenerator()) {
        if (v.toGenerator().device().type() != c10::DeviceType::CPU) return false;
        cpu.push_back(v);
      } else if (v.isTensorList() || v.isList() || v.isObject() || v.isCapsule()) {
        return false;
      } else {
        cpu.push_back(v);
      }
    }
    if (!neuron) return false;
    op.redispatchBoxed(kCpuKeys, &cpu);
    g_host_runs.fetch_add(1, std::memory_order_relaxed);
    torch::jit::drop(s, n);
    for (c10::IValue& r : cpu) {
      s.emplace_back(r.isTensor() && r.toTensor().defined() ? c10::IValue(to_neuron_fresh(std::move(r).toTensor()))
                                                              : std::move(r));
    }
    return true;
  }
};

// A boxed kernel with the op's Python kernel behind it (`python` calls it; its key tables stay unused),
// registered for neuron in the Python kernel's place.
template <class K>
void register_with_python(const std::string& qualname, std::unique_ptr<K> k, std::vector<bool> kwarg_only,
                          std::vector<std::string> names, py::object kernel) {
  k->python = std::make_unique<OpState>();
  k->python->kinds.assign(kwarg_only.size(), VALUE);
  k->python->kwarg_only = std::move(kwarg_only);
  k->python->names = std::move(names);
  k->python->kernel = kernel.release().ptr();
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  library().impl(op_name(qualname).c_str(),
                 torch::CppFunction::makeFromBoxedKernel(c10::BoxedKernel::makeFromFunctor(std::move(k))));
}

void register_host(const std::string& qualname, std::vector<bool> kwarg_only, std::vector<std::string> names,
                   py::object kernel) {
  register_with_python(qualname, std::make_unique<HostKernel>(), std::move(kwarg_only), std::move(names),
                       std::move(kernel));
}

void register_special(const std::string& qualname, int which, std::vector<bool> kwarg_only,
                      std::vector<std::string> names, py::object kernel) {
  auto k = std::make_unique<SpecialKernel>();
  k->which = static_cast<Special>(which);
  register_with_python(qualname, std::move(k), std::move(kwarg_only), std::move(names), std::move(kernel));
}

void register_compute(const std::string& qualname, std::vector<int> kinds, std::vector<bool> kwarg_only,
                      std::vector<std::string> names, int mutated, size_t n_returns, bool returns_list,
                      py::object kernel, py::object lookup, std::vector<int> mutated_lists,
                      bool full_overlap_ok) {
  auto state = std::make_unique<OpState>();
  state->full_overlap_ok = full_overlap_ok;
  state->several_mutated = mutated_lists.size() > 1;
  state->mutated_lists = std::move(mutated_lists);
  state->kinds = std::move(kinds);
  state->kwarg_only = std::move(kwarg_only);
  state->names = std::move(names);
  state->mutated = mutated;
  state->n_returns = n_returns;
  state->returns_list = returns_list;
  state->kernel = kernel.release().ptr();
  state->lookup = lookup.release().ptr();
  state->generation = g_generation.load();
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  if (mutated < 0 && n_returns == 1 && !returns_list) {
    auto it = typed_ops().find(qualname);
    if (it != typed_ops().end() && it->second(state)) return;
  }
  library().impl(op_name(qualname).c_str(),
                 torch::CppFunction::makeFromBoxedKernel(c10::BoxedKernel::makeFromFunctor(std::move(state))));
}

// Forget every executable (the Python side cleared or evicted its own): entries are dropped lazily,
// by generation, so the hit path never waits for a sweep.
void clear() { g_generation.fetch_add(1); }

}  // namespace

#include "process_group.h"  // the neuron c10d backend: uses cpu_view and to_neuron above

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "neuron-runtime's native hit path";
  m.def("to_neuron", &to_neuron, "A neuron tensor over a CPU tensor's memory");
  m.def("to_cpu", &to_cpu, "A CPU tensor over a neuron tensor's memory");
  m.def("has_cpu_view", [](const at::Tensor& t) {
    if (fresh_view(t) != nullptr) return true;
    std::lock_guard<neuron_memory::SpinLock> lock(g_view_mu);
    auto* c = dynamic_cast<CpuView*>(t.unsafeGetTensorImpl()->get_backend_meta());
    return c != nullptr && fits(*c, t);
  }, "whether the native path has a CPU view of the tensor that still fits it (cpu_view)");
  m.def("register_view", &register_view);
  m.def("register_device_guard", &register_device_guard, "False if PrivateUse1 already has a guard");
  m.def("register_allocator", &neuron_memory::register_allocator, "PrivateUse1's allocator (memory.h)");
  m.def("memory_stats", []() {
    const auto s = neuron_memory::device_stats();
    const auto& b = s.allocated_bytes[0];
    return py::make_tuple(b.current, b.peak, b.allocated, b.freed, s.allocation[0].current);
  }, "bytes of live neuron memory: (current, peak, allocated, freed, live buffers)");
  m.def("reset_peak_memory", &neuron_memory::reset_peak);
  m.def("set_memory_capacity", &neuron_memory::set_capacity,
        "the device's capacity in bytes (0: host memory), or the error a query raises (memory.h)");
  m.def("memory_info", [](int device) { return neuron_memory::memory_info(static_cast<c10::DeviceIndex>(device)); },
        "(free, total) bytes of the device, as torch.accelerator.get_memory_info");
  m.def("reset_accumulated_memory", &neuron_memory::reset_accumulated);
  m.def("empty_cache", &neuron_memory::empty_cache, "give freed host memory back to the OS");
  m.def("register_hooks", &register_hooks, "False if PrivateUse1 already has hooks");
  m.def("register_compute", &register_compute);
  m.def("register_special", &register_special);
  m.def("register_host", &register_host, "a random host op served natively (HostKernel)");
  m.def("set_host_native", [](bool on) { g_host_native.store(on); },
        "whether HostKernel serves random host ops (False: every call through the Python kernel)");
  m.def("host_runs", []() { return g_host_runs.load(); }, "host ops HostKernel ran since reset_counters()");
  m.def("clear", &clear);
  m.def("set_fusion", &set_fusion, "fusion's flush(reason), _native_started(), _flush_from_native(nodes, "
        "live) and buffer limit; Nones when fusion is off");
  py::class_<AotiRunner>(m, "AotiRunner", "an aoti executable's run from Python (aoti_runner)")
      .def("__call__", &AotiRunner::operator());
  m.def("aoti_runner", &aoti_runner, "loader.run's replacement: the runner's single-threaded entry under the "
        "lock the native paths take; None for a runner without it");
  py::class_<GraphRunner>(m, "GraphRunner", "A torch.compile graph's executable called natively (_compile.py)")
      .def(py::init<py::object, std::vector<int64_t>, std::vector<std::pair<int64_t, int64_t>>,
                    std::vector<int64_t>, std::vector<std::pair<int, int64_t>>, std::vector<bool>,
                    std::vector<at::Tensor>>())
      .def("__call__", &GraphRunner::call);
  py::class_<KernelAutograd, std::shared_ptr<KernelAutograd>>(
      m, "KernelAutograd", "a kernel's eager call with its backward, as a C++ autograd node (kernels/_kernel.py)")
      .def(py::init<std::string, py::object, size_t, py::object, const py::list&, py::object, std::vector<size_t>,
                    const py::list&>())
      .def("__call__", [](KernelAutograd& k, const py::args& a) { return k.call(a); })
      .def("try_call", &KernelAutograd::try_call);
  m.def("graph_runs", []() { return g_graph_runs.load(); }, "graphs kernels' native autograd calls ran");
  m.def("forget_kernels", []() { g_runtime.fetch_add(1); }, "a new runtime: every KernelAutograd declines");
  m.def("recheck_groups", []() {
    for (auto& [words, g] : g_groups) {
      if (g->each && g->recheck_at > 0) g->recheck_at = 1;
    }
  }, "hand the groups run op by op while their executables compile back to Python at their next flush");
  m.def("run_queue", &run_queue, "run the native fusion queue (fusion.flush does)");
  m.def("fusion_counters", &fusion_counters, "the native queue's counters since reset_counters()");
  m.def("set_pending", [](bool pending) { g_pending.store(pending); }, "whether fusion has queued ops");
  m.def("executions", []() { return g_executions.load(); }, "Hits served natively since reset_counters()");
  m.def("typed_executions", []() { return g_typed_executions.load(); }, "Of those, the hits typed kernels served");
  m.def("register_profiler", &neuron_trace::register_profiler,
        "register the device's Kineto activity profiler (trace.h); False if this torch has no Kineto");
  m.def("tracing", &neuron_trace::on, "whether a profiler records the device's activity now");
  m.def("trace_now", &neuron_trace::now, "the clock device activity is recorded with (ns)");
  m.def("trace_run", [](py::tuple label, int32_t track, int64_t start) {
    if (!neuron_trace::on()) return;
    neuron_trace::record(neuron_trace::label_of(label[0].cast<std::string>(), label[1].cast<std::string>(),
                                                label[2].cast<std::string>(), label[3].cast<std::string>()),
                         track, start);
  }, "record a run made in Python since `start` (trace_now()): label (name, key, kind, shape class), track");
  neuron_pg::bind(m);
  m.def("reset_counters", []() {
    g_executions.store(0);
    g_host_runs.store(0);
    g_typed_executions.store(0);
    g_q_buffered.store(0);
    g_q_fused_runs.store(0);
    g_q_ops_fused.store(0);
    g_q_not_materialised.store(0);
    g_q_run_each.store(0);
    g_graph_runs.store(0);
  });
}

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &neuron_sdp_choice)
}  // namespace at::native
