// The `neuron` c10d backend (included by fastpath.cpp after its relabelling functions; see
// docs/distributed.md and neuron_runtime/distributed/_group.py, which makes it).
//
// A neuron tensor's memory is host memory, so a collective needs no copy: every tensor argument is handed
// to a gloo backend as the CPU view of the same bytes (`cpu_view`, made once per tensor and kept), and the
// results land in the caller's neuron tensors because they are those bytes. Everything on the way is C++:
// DDP's reducer, FSDP2 and `torch.distributed`'s Python API reach these methods through c10d's dispatcher,
// and gloo's threads complete the futures, without the GIL (the Python group this replaces cost ~60 us and
// two GIL hand-offs per collective).
//
// What this layer adds to gloo: a clear error for a tensor of another device, errors that name the
// collective, this rank and the shapes (a dead peer at once, a hung one after the group's timeout), results
// and futures that hold the caller's neuron tensors, coalescing blocks, and per-collective counters
// (`stats()["collectives"]`). PyTorch's own desynchronization checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) wrap
// this backend as they wrap nccl's.

#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace neuron_pg {

// The collectives as `torch.distributed` names them (errors, counters). c10d's variants of one collective
// (list and tensor forms, coalesced or not) keep their own names: they are different calls to a user.
enum Coll : int {
  kAllReduce, kAllReduceCoalesced, kBroadcast, kReduce, kAllGather, kAllGatherCoalesced, kAllGatherIntoTensor,
  kAllGatherIntoTensorCoalesced, kGather, kScatter, kReduceScatter, kReduceScatterTensor,
  kReduceScatterTensorCoalesced, kAllToAllSingle, kAllToAll, kSend, kRecv, kBarrier, kCollCount
};
constexpr std::array<const char*, kCollCount> kNames = {
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all", "send", "recv",
    "barrier"};

struct Counter {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> bytes{0};
};
inline std::array<Counter, kCollCount> g_counts;

using TensorList = std::vector<at::Tensor>;
using TensorLists = std::vector<TensorList>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// One call's tensor arguments as CPU views, and the way back from a view to the caller's tensor.
struct Call {
  Coll coll;
  int rank;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;  // (CPU view, neuron tensor)
  int64_t nbytes = 0;

  Call(Coll c, int r) : coll(c), rank(r) {}

  at::Tensor view(const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.device().type() == c10::DeviceType::PrivateUse1, kNames[coll],
                      ": expected neuron tensors, got a tensor on ", t.device(),
                      " - the 'neuron' process group carries neuron tensors only (for CPU tensors use a gloo "
                      "group: dist.new_group(backend='gloo'))");
    at::Tensor v = cpu_view(t);
    pairs.emplace_back(v, t);
    nbytes += static_cast<int64_t>(t.nbytes());
    return v;
  }
  at::Tensor views(const at::Tensor& t) { return view(t); }
  TensorList views(const TensorList& ts) {
    TensorList out;
    out.reserve(ts.size());
    for (const at::Tensor& t : ts) out.push_back(view(t));
    return out;
  }
  TensorLists views(const TensorLists& ls) {
    TensorLists out;
    out.reserve(ls.size());
    for (const TensorList& l : ls) out.push_back(views(l));
    return out;
  }

  // A result tensor of gloo's as the caller's neuron tensor: the same object where it is one of the views.
  at::Tensor restore(const at::Tensor& t) const {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU) return t;
    for (const auto& [v, orig] : pairs)
      if (v.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return orig;
    for (const auto& [v, orig] : pairs)
      if (v.data_ptr() == t.data_ptr() && v.sizes() == t.sizes() && v.dtype() == t.dtype()) return orig;
    return to_neuron(t);
  }
  TensorList restore(const TensorList& ts) const {
    TensorList out;
    out.reserve(ts.size());
    for (const at::Tensor& t : ts) out.push_back(restore(t));
    return out;
  }
  c10::IValue restore(const c10::IValue& v) const {
    if (v.isTensor()) return restore(v.toTensor());
    if (v.isTensorList()) return restore(v.toTensorVector());
    if (v.isList()) {  // lists of tensor lists (allgather's outputs)
      c10::impl::GenericList out(v.toList().elementType());
      for (const c10::IValue& e : v.toList()) out.push_back(restore(e));
      return out;
    }
    return v;
  }

  std::string describe() const {
    std::string s;
    for (size_t i = 0; i < pairs.size() && i < 4; ++i) {
      if (i) s += ", ";
      s += c10::str(pairs[i].second.sizes());
    }
    return s.empty() ? "no tensors" : s;
  }
  // What a failure of this call reaches the caller as: the collective, this rank, the shapes, the cause.
  std::exception_ptr error(const std::exception_ptr& cause) const {
    std::string why;
    try {
      std::rethrow_exception(cause);
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace();
    } catch (const std::exception& e) {
      why = e.what();
    }
    return std::make_exception_ptr(c10::DistBackendError(
        c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        c10::str(kNames[coll], " failed on rank ", rank, " (", describe(), "): ", why)));
  }
};

// gloo's Work with errors that name the collective and results (and futures) that are neuron tensors.
class NeuronWork : public c10d::Work {
 public:
  NeuronWork(WorkPtr inner, std::shared_ptr<const Call> call)
      : c10d::Work(call->rank, inner->retrieveOpType()), inner_(std::move(inner)), call_(std::move(call)) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override {
    auto e = inner_->exception();
    return e ? call_->error(e) : e;
  }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return call_->restore(inner_->result()); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return inner_->wait(timeout);
    } catch (...) {
      std::rethrow_exception(call_->error(std::current_exception()));
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> g(mu_);
    if (!future_) {
      auto inner = inner_->getFuture();
      auto fut = c10::make_intrusive<c10::ivalue::Future>(inner->elementType());
      inner->addCallback([fut, call = call_](c10::ivalue::Future& f) {
        if (f.hasError()) {
          fut->setError(call->error(f.exception_ptr()));
        } else {
          fut->markCompleted(call->restore(f.value()));
        }
      });
      future_ = std::move(fut);
    }
    return future_;
  }

 private:
  WorkPtr inner_;
  std::shared_ptr<const Call> call_;
  std::mutex mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The Work of a coalescing block: done when every collective issued inside it is.
class AllWork : public c10d::Work {
 public:
  explicit AllWork(std::vector<WorkPtr> works, int rank)
      : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    for (auto& w : works_)
      if (!w->isCompleted()) return false;
    return true;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = true;
    for (auto& w : works_) ok = w->wait(timeout) && ok;
    return ok;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
        c10::FutureType::create(c10::ListType::ofTensors()));
    for (auto& w : works_) futures.push_back(w->getFuture());
    return c10::collectAll(futures);
  }

 private:
  std::vector<WorkPtr> works_;
};

class NeuronBackend : public c10d::Backend {
 public:
  NeuronBackend(c10::intrusive_ptr<c10d::Backend> transport, int rank, int size)
      : c10d::Backend(rank, size), gloo_(std::move(transport)) {}

  const std::string getBackendName() const override { return "neuron"; }
  bool supportsCoalescing() const override { return true; }

  void startCoalescing() override {
    std::lock_guard<std::mutex> g(mu_);
    coalesced_.emplace();
  }
  WorkPtr endCoalescing() override {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<WorkPtr> works = coalesced_ ? std::move(*coalesced_) : std::vector<WorkPtr>{};
    coalesced_.reset();
    return c10::make_intrusive<AllWork>(std::move(works), rank_);
  }

  WorkPtr broadcast(TensorList& ts, const c10d::BroadcastOptions& o) override {
    return one(kBroadcast, ts, [&](TensorList& v) { return gloo_->broadcast(v, o); });
  }
  WorkPtr allreduce(TensorList& ts, const c10d::AllreduceOptions& o) override {
    return one(kAllReduce, ts, [&](TensorList& v) { return gloo_->allreduce(v, o); });
  }
  WorkPtr allreduce_coalesced(TensorList& ts, const c10d::AllreduceCoalescedOptions& o) override {
    return one(kAllReduceCoalesced, ts, [&](TensorList& v) { return gloo_->allreduce_coalesced(v, o); });
  }
  WorkPtr reduce(TensorList& ts, const c10d::ReduceOptions& o) override {
    return one(kReduce, ts, [&](TensorList& v) { return gloo_->reduce(v, o); });
  }
  WorkPtr send(TensorList& ts, int dst, int tag) override {
    return one(kSend, ts, [&](TensorList& v) { return gloo_->send(v, dst, tag); });
  }
  WorkPtr recv(TensorList& ts, int src, int tag) override {
    return one(kRecv, ts, [&](TensorList& v) { return gloo_->recv(v, src, tag); });
  }
  WorkPtr recvAnysource(TensorList& ts, int tag) override {
    return one(kRecv, ts, [&](TensorList& v) { return gloo_->recvAnysource(v, tag); });
  }
  WorkPtr allgather(TensorLists& outs, TensorList& ins, const c10d::AllgatherOptions& o) override {
    return two(kAllGather, outs, ins, [&](auto& vo, auto& vi) { return gloo_->allgather(vo, vi, o); });
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return two(kAllGatherIntoTensor, out, in, [&](auto& vo, auto& vi) { return gloo_->_allgather_base(vo, vi, o); });
  }
  WorkPtr allgather_coalesced(TensorLists& outs, TensorList& ins, const c10d::AllgatherOptions& o) override {
    return two(kAllGatherCoalesced, outs, ins,
               [&](auto& vo, auto& vi) { return gloo_->allgather_coalesced(vo, vi, o); });
  }
  WorkPtr allgather_into_tensor_coalesced(TensorList& outs, TensorList& ins, const c10d::AllgatherOptions& o) override {
    return two(kAllGatherIntoTensorCoalesced, outs, ins,
               [&](auto& vo, auto& vi) { return gloo_->allgather_into_tensor_coalesced(vo, vi, o); });
  }
  WorkPtr gather(TensorLists& outs, TensorList& ins, const c10d::GatherOptions& o) override {
    return two(kGather, outs, ins, [&](auto& vo, auto& vi) { return gloo_->gather(vo, vi, o); });
  }
  WorkPtr scatter(TensorList& outs, TensorLists& ins, const c10d::ScatterOptions& o) override {
    return two(kScatter, outs, ins, [&](auto& vo, auto& vi) { return gloo_->scatter(vo, vi, o); });
  }
  WorkPtr reduce_scatter(TensorList& outs, TensorLists& ins, const c10d::ReduceScatterOptions& o) override {
    return two(kReduceScatter, outs, ins, [&](auto& vo, auto& vi) { return gloo_->reduce_scatter(vo, vi, o); });
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    return two(kReduceScatterTensor, out, in,
               [&](auto& vo, auto& vi) { return gloo_->_reduce_scatter_base(vo, vi, o); });
  }
  WorkPtr reduce_scatter_tensor_coalesced(TensorList& outs, TensorList& ins,
                                          const c10d::ReduceScatterOptions& o) override {
    return two(kReduceScatterTensorCoalesced, outs, ins,
               [&](auto& vo, auto& vi) { return gloo_->reduce_scatter_tensor_coalesced(vo, vi, o); });
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return two(kAllToAllSingle, out, in,
               [&](auto& vo, auto& vi) { return gloo_->alltoall_base(vo, vi, out_splits, in_splits, o); });
  }
  WorkPtr alltoall(TensorList& outs, TensorList& ins, const c10d::AllToAllOptions& o) override {
    return two(kAllToAll, outs, ins, [&](auto& vo, auto& vi) { return gloo_->alltoall(vo, vi, o); });
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    c10d::BarrierOptions cpu = o;
    cpu.device = c10::Device(c10::DeviceType::CPU);  // gloo's barrier (it allocates a CPU tensor)
    return run(kBarrier, [&](Call&) { return gloo_->barrier(cpu); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(o, wait_all_ranks);
  }

  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    gloo_->setGroupUid(uid);
  }
  void abort() override { gloo_->abort(); }
  void shutdown() override { gloo_->shutdown(); }

 private:
  // A collective of one tensor list, and one of outputs and inputs: gloo's `call` on their views.
  template <typename F>
  WorkPtr one(Coll coll, const TensorList& ts, F&& call) {
    return run(coll, [&](Call& c) {
      auto v = c.views(ts);
      return call(v);
    });
  }
  template <typename Out, typename In, typename F>
  WorkPtr two(Coll coll, const Out& outs, const In& ins, F&& call) {
    return run(coll, [&](Call& c) {
      auto vo = c.views(outs);
      auto vi = c.views(ins);
      return call(vo, vi);
    });
  }

  // Issue one collective: views, gloo's call, errors that name it, the counters, the coalescing block.
  template <typename F>
  WorkPtr run(Coll coll, F&& issue) {
    auto call = std::make_shared<Call>(coll, rank_);
    WorkPtr inner;
    try {
      inner = issue(*call);
    } catch (const c10::ValueError&) {
      throw;  // the wrong device (Call::view) or gloo's own argument checks: as they are
    } catch (const c10::Error&) {
      std::rethrow_exception(call->error(std::current_exception()));  // as a failure after issuing would be
    }
    g_counts[coll].calls.fetch_add(1, std::memory_order_relaxed);
    g_counts[coll].bytes.fetch_add(call->nbytes, std::memory_order_relaxed);
    WorkPtr w = c10::make_intrusive<NeuronWork>(std::move(inner), std::move(call));
    std::lock_guard<std::mutex> g(mu_);
    if (coalesced_) coalesced_->push_back(w);
    return w;
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::mutex mu_;
  std::optional<std::vector<WorkPtr>> coalesced_;
};

inline void bind(pybind11::module& m) {
  m.def("process_group", [](c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size) {
    return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<NeuronBackend>(std::move(gloo), rank, size));
  }, "The neuron c10d backend over a gloo backend of the same ranks (distributed/_group.py)");
  m.def("collective_counts", []() {
    pybind11::dict out;
    for (int i = 0; i < kCollCount; ++i) {
      const int64_t calls = g_counts[i].calls.load();
      if (calls) out[kNames[i]] = pybind11::make_tuple(calls, g_counts[i].bytes.load());
    }
    return out;
  }, "collectives run through neuron groups: name -> (calls, bytes)");
}

}  // namespace neuron_pg
