// The neuron device's activity for torch.profiler (included by fastpath.cpp; README "Profiling").
//
// A Kineto activity profiler registered through PyTorch's PrivateUse1 profiler registry
// (torch/csrc/profiler/standalone/privateuse1_profiler.h): with `ProfilerActivity.PrivateUse1` among a
// profile's activities (the default), Kineto configures a session of it, and every executable run the
// native layer makes while it records becomes a device activity on the `neuron` process of the trace:
//   * one track per kind of executable: ops, fused groups, torch.compile graphs;
//   * named by the executable's op; its cache key, kind and shape class as the activity's metadata;
//   * linked to the aten op it ran for (Kineto's correlation id, pushed for every op), so
//     `key_averages()` counts it as that op's NEURON time, as it counts a CUDA kernel.
// With no session recording, what the hit path pays is one relaxed load of `g_on` and a branch
// (`on()`); the clock is read, and a run recorded, only while a session records.
// Without Kineto in this torch build (`USE_KINETO` undefined) nothing registers and `on()` is never true.

#pragma once

#include <c10/util/ApproximateClock.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifdef USE_KINETO
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <libkineto.h>
#include <output_base.h>
#endif

namespace neuron_trace {

// What a run is labelled with: read once per executable from its `__neuron_trace__` (Python sets it
// when the executable enters the memory tier: executables/_resolver.py).
struct Label {
  std::string name;         // the op (or `fused:...` / `graph:...`)
  std::string key;          // the cache key of the executable
  std::string kind;         // op | class | fused | graph
  std::string shape_class;  // exact | flat | ranked
};

enum Track : int32_t { OPS = 0, FUSED = 1, GRAPHS = 2 };

struct Run {
  int64_t start;  // ns, c10::getTime()'s clock (the one PyTorch's CPU events are converted to)
  int64_t end;
  uint64_t corr;  // the aten op's correlation id (0: none, e.g. a thread the profiler does not follow)
  int32_t track;
  std::shared_ptr<const Label> label;
};

inline std::atomic<bool> g_on{false};
inline std::mutex g_mu;
inline std::vector<Run> g_runs;  // under g_mu
inline int64_t g_dropped = 0;    // runs past kMaxRuns (under g_mu)
constexpr size_t kMaxRuns = 1 << 22;  // ~200 MB of records at most; a longer profile drops the rest

// The correlation ids Kineto pushes around each op on this thread (the innermost is the op running).
inline thread_local std::vector<uint64_t> t_corr;

inline bool on() { return g_on.load(std::memory_order_relaxed); }
inline int64_t now() { return c10::getTime(); }

// Cold by design: only called while a session records.
__attribute__((noinline, cold)) inline void record(const std::shared_ptr<const Label>& label, int32_t track,
                                                   int64_t start) {
  const int64_t end = now();
  const uint64_t corr = t_corr.empty() ? 0 : t_corr.back();
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_on.load(std::memory_order_relaxed)) return;  // the session stopped meanwhile
  if (g_runs.size() >= kMaxRuns) {
    ++g_dropped;
    return;
  }
  g_runs.push_back({start, end, corr, track, label});
}

// A label from Python: None, or a tuple (name, key, kind, shape class) of strings.
inline std::shared_ptr<const Label> label_of(const std::string& name, const std::string& key,
                                             const std::string& kind, const std::string& shape_class) {
  return std::make_shared<const Label>(Label{name, key, kind, shape_class});
}

#ifdef USE_KINETO

// Activities point at a span for their trace; one that lives for the process (a session's buffer moves).
inline const libkineto::TraceSpan& span() {
  static const auto* s = new libkineto::TraceSpan(0, 0, "neuron");
  return *s;
}

class Session final : public libkineto::IActivityProfilerSession {
 public:
  // `records`: the profile asked for device activity (Kineto configures child profilers for CPU-only
  // profiles too; such a session records nothing, so the hit path stays untraced).
  explicit Session(bool records) : records_(records) {}

  void start() override {
    status_ = libkineto::TraceStatus::RECORDING;
    if (!records_) return;
    {
      std::lock_guard<std::mutex> g(g_mu);
      g_runs.clear();
      g_dropped = 0;
    }
    g_on.store(true);
  }

  void stop() override {
    status_ = libkineto::TraceStatus::PROCESSING;
    if (!records_) return;
    g_on.store(false);
    std::lock_guard<std::mutex> g(g_mu);
    runs_.swap(g_runs);
    dropped_ = g_dropped;
  }

  std::vector<std::string> errors() override {
    if (dropped_ == 0) return {};
    return {"neuron: " + std::to_string(dropped_) + " executable runs past " + std::to_string(kMaxRuns) +
            " were not recorded"};
  }

  void processTrace(libkineto::ActivityLogger& logger) override { log(logger, nullptr); }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked,
                    int64_t, int64_t) override {
    log(logger, &linked);
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{0, 0, "neuron", "neuron:0"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    return {libkineto::ResourceInfo{OPS, OPS, 0, "executables"},
            libkineto::ResourceInfo{FUSED, FUSED, 0, "fused groups"},
            libkineto::ResourceInfo{GRAPHS, GRAPHS, 0, "torch.compile graphs"}};
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    auto b = std::make_unique<libkineto::CpuTraceBuffer>();
    b->span = span();
    return b;  // the runs went to the logger (processTrace)
  }

  void pushCorrelationId(uint64_t id) override { t_corr.push_back(id); }
  void popCorrelationId() override {
    if (!t_corr.empty()) t_corr.pop_back();
  }

 private:
  void log(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback* linked) {
    int32_t id = 0;
    for (const Run& r : runs_) {
      libkineto::GenericTraceActivity a(span(), libkineto::ActivityType::CONCURRENT_KERNEL, r.label->name);
      a.startTime = r.start;
      a.endTime = r.end;
      a.id = ++id;
      a.device = 0;
      a.resource = r.track;
      a.linked = (linked != nullptr && r.corr != 0) ? (*linked)(static_cast<int32_t>(r.corr)) : nullptr;
      a.addMetadataQuoted("key", r.label->key);
      a.addMetadataQuoted("kind", r.label->kind);
      a.addMetadataQuoted("shape class", r.label->shape_class);  // (addMetadata needs fmt's library)
      logger.handleGenericActivity(a);
    }
    runs_.clear();
  }

  bool records_;
  std::vector<Run> runs_;
  int64_t dropped_ = 0;
};

class Profiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    return std::make_unique<Session>(types.count(libkineto::ActivityType::CONCURRENT_KERNEL) > 0);
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  // What PyTorch asks of a PrivateUse1 device (kineto_shim's kPrivateUse1Types) and this one records.
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL};
};

// Register with PyTorch's PrivateUse1 profiler registry (it hands the factory to Kineto when Kineto
// starts, or at once if it has). True if registered.
inline bool register_profiler() {
  static bool done = [] {
    torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().registerFactory(
        [] { return std::unique_ptr<libkineto::IActivityProfiler>(new Profiler()); });
    return true;
  }();
  return done;
}

#else

inline bool register_profiler() { return false; }

#endif  // USE_KINETO

}  // namespace neuron_trace
