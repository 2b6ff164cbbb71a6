#include "lib/planner/calibration.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/params.h"
#include "lib/planner/cost_model.h"
#include "lib/sched/json_text.h"
#include "nlohmann/json.hpp"

namespace hsap {
namespace {

using nlohmann::json;

constexpr const char* kEngineNames[] = {"auto", "jit", "cudnn", "fa2", "fa3"};
constexpr int kBuiltinHeadDim = 128;
// The block length at which a calibrated kind's attention_efficiency (the flat figure the
// search's shares follow) is read off its rates.
constexpr double kShareBlockTokens = 16384;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("calibration: ", message));
}

// Sources of the built-in figures (docs/cost_model.md, section 1, cites them in full).
constexpr char kH200Measured[] = "built-in H200 (measured 2026-12)";
constexpr char kH100FromH200[] = "built-in H200 measurement (2026-12; same GH100 compute)";
constexpr char kFa3Paper[] = "built-in FlashAttention-3 paper, H100 (published)";
constexpr char kFa2OnH100[] = "built-in FlashAttention-2 on H100 (FlashAttention-3 paper)";
constexpr char kA100Fa2[] = "built-in FlashAttention-2 on A100 (ring-flash-attention README)";
constexpr char kJitByPeak[] = "built-in H200 JIT fraction of peak (assumed)";
constexpr char kL40sAssumed[] = "built-in A100 FA2-class x 0.97 (assumed)";

// Relative short-block shapes (docs/cost_model.md): H100, bf16, head dim 128, causal
// forward, backward from the FlashAttention-3 paper's non-causal figure (it has no causal
// backward one), normalised to their 16K value.
RateShape ShapeOf(const std::vector<double>& tflops) {
  RateShape shape;
  const double lengths[] = {512, 1024, 2048, 4096, 8192, 16384};
  for (size_t i = 0; i < tflops.size(); ++i) {
    shape.points.push_back({lengths[i], tflops[i] / tflops.back()});
  }
  return shape;
}
const std::vector<double> kCudnnFwdH100 = {315, 410, 484, 518, 529, 539};
const std::vector<double> kCudnnBwdH100 = {305, 408, 465, 499, 518, 516};
const std::vector<double> kFa3Fwd = {292, 423, 521, 579, 602, 616};
const std::vector<double> kFa3Bwd = {316, 424, 501, 542, 559, 561};
const std::vector<double> kFa2FwdH100 = {191, 260, 298, 319, 333, 335};
const std::vector<double> kFa2BwdH100 = {214, 260, 291, 310, 318, 322};

// The shape an engine's curve follows below its shortest point. The JIT kernels' short-block
// loss has not been measured: they take FlashAttention-2's (mma.sync-class) shape.
RateShape BuiltinShape(const std::string& engine, bool backward) {
  if (engine == "cudnn") return ShapeOf(backward ? kCudnnBwdH100 : kCudnnFwdH100);
  if (engine == "fa3") return ShapeOf(backward ? kFa3Bwd : kFa3Fwd);
  return ShapeOf(backward ? kFa2BwdH100 : kFa2FwdH100);
}

void AddCurve(Calibration* c, const std::string& kind, const std::string& engine, bool backward,
              const std::vector<std::pair<double, double>>& points, const char* source) {
  for (auto [block, tflops] : points) {
    c->rates.push_back({kind, engine, backward, block, kBuiltinHeadDim, tflops, source});
  }
}

// A curve over the six lengths of the FlashAttention-3 paper's figures.
std::vector<std::pair<double, double>> PaperCurve(const std::vector<double>& tflops) {
  std::vector<std::pair<double, double>> points;
  const double lengths[] = {512, 1024, 2048, 4096, 8192, 16384};
  for (size_t i = 0; i < tflops.size(); ++i) points.push_back({lengths[i], tflops[i]});
  return points;
}

Calibration MakeBuiltin() {
  Calibration c;
  c.name = "built-in";
  // H200, one GPU, bf16, 16 heads, d 128, one causal document (docs/gpu_backend.md).
  const std::vector<std::pair<double, double>> cudnn_fwd = {{32768, 586.77}, {131072, 540.25}};
  const std::vector<std::pair<double, double>> cudnn_bwd = {{32768, 516.72}, {131072, 523.20}};
  const std::vector<std::pair<double, double>> jit_fwd = {{32768, 137.28}, {131072, 142.42}};
  const std::vector<std::pair<double, double>> jit_bwd = {{32768, 92.65}, {131072, 88.93}};
  for (const char* kind : {"H200", "H100"}) {
    const char* source = std::string(kind) == "H200" ? kH200Measured : kH100FromH200;
    AddCurve(&c, kind, "cudnn", false, cudnn_fwd, source);
    AddCurve(&c, kind, "cudnn", true, cudnn_bwd, source);
    AddCurve(&c, kind, "jit", false, jit_fwd, source);
    AddCurve(&c, kind, "jit", true, jit_bwd, source);
    AddCurve(&c, kind, "fa3", false, PaperCurve(kFa3Fwd), kFa3Paper);
    AddCurve(&c, kind, "fa3", true, PaperCurve(kFa3Bwd), kFa3Paper);
    AddCurve(&c, kind, "fa2", false, PaperCurve(kFa2FwdH100), kFa2OnH100);
    AddCurve(&c, kind, "fa2", true, PaperCurve(kFa2BwdH100), kFa2OnH100);
  }
  // A100 (and A800, the same chip): FlashAttention-2's single-GPU flash_attn at 8K, Llama
  // 3.1 8B heads; cuDNN on Ampere taken as FA2-class. The JIT kernels: the fraction of the
  // dense peak they reach on the H200, on 312 TFLOP/s. L40S: A100's x 362.05/312 x 0.5/0.6.
  const double a100_jit = 312 / 989.4, l40s = 362.05 / 312 * 0.5 / 0.6;
  const double l40s_jit = 362.05 / 989.4;
  for (const char* kind : {"A100", "A800", "L40S"}) {
    const bool is_l40s = std::string(kind) == "L40S";
    const double k = is_l40s ? l40s : 1.0, kj = is_l40s ? l40s_jit : a100_jit;
    const char* source = is_l40s ? kL40sAssumed : kA100Fa2;
    for (const char* engine : {"fa2", "cudnn"}) {
      AddCurve(&c, kind, engine, false, {{8192, 205.28 * k}}, source);
      AddCurve(&c, kind, engine, true, {{8192, 174.38 * k}}, source);
    }
    std::vector<std::pair<double, double>> jf, jb;
    for (auto [l, t] : jit_fwd) jf.push_back({l, t * kj});
    for (auto [l, t] : jit_bwd) jb.push_back({l, t * kj});
    AddCurve(&c, kind, "jit", false, jf, kJitByPeak);
    AddCurve(&c, kind, "jit", true, jb, kJitByPeak);
  }
  // Dense GEMMs (projections, MLP) and NCCL's share of the SMs: assumptions
  // (docs/cost_model.md): 8 of the SMs (132 on H100/H200, 108 on A100/A800, 142 on L40S).
  c.gemm_efficiency = {
      {"H100", 0.70}, {"H200", 0.70}, {"A100", 0.80}, {"A800", 0.80}, {"L40S", 0.60}};
  c.nccl_compute_fraction = {{"H100", 8.0 / 132},
                             {"H200", 8.0 / 132},
                             {"A100", 8.0 / 108},
                             {"A800", 8.0 / 108},
                             {"L40S", 8.0 / 142}};
  c.step_overhead_us = 10;
  c.link_efficiency = 0.85;
  c.half_bandwidth_kib = 256;
  return c;
}

absl::StatusOr<double> ReadNumber(const json& object, const char* field, const std::string& where,
                                  double low, double high, bool low_open) {
  auto it = object.find(field);
  if (it == object.end()) return Invalid(absl::StrCat(where, " lacks the field \"", field, "\""));
  if (!it->is_number()) return Invalid(absl::StrCat(where, ".", field, " must be a number"));
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < low || (low_open && v == low) || v > high) {
    return Invalid(absl::StrCat(where, ".", field, " = ", v, " must be in ", low_open ? "(" : "[",
                                low, ", ", high, "]"));
  }
  return v;
}

absl::StatusOr<CalibrationRate> ReadRate(const json& e, const std::string& where) {
  if (!e.is_object()) return Invalid(absl::StrCat(where, " must be an object"));
  CalibrationRate r;
  for (auto [field, out] : {std::pair{"device_kind", &r.device_kind}, {"engine", &r.engine}}) {
    auto it = e.find(field);
    if (it == e.end() || !it->is_string() || it->get<std::string>().empty()) {
      return Invalid(absl::StrCat(where, " lacks the string field \"", field, "\""));
    }
    *out = it->get<std::string>();
  }
  if (r.engine != "jit" && r.engine != "cudnn" && r.engine != "fa2" && r.engine != "fa3") {
    return Invalid(
        absl::StrCat(where, ".engine = \"", r.engine, "\" is none of jit, cudnn, fa2, fa3"));
  }
  auto dir = e.find("direction");
  if (dir == e.end() || !dir->is_string() ||
      (dir->get<std::string>() != "forward" && dir->get<std::string>() != "backward")) {
    return Invalid(absl::StrCat(where, ".direction must be \"forward\" or \"backward\""));
  }
  r.backward = dir->get<std::string>() == "backward";
  auto block = ReadNumber(e, "block_tokens", where, 0, 1e12, true);
  if (!block.ok()) return block.status();
  auto head_dim = ReadNumber(e, "head_dim", where, 0, 1 << 16, true);
  if (!head_dim.ok()) return head_dim.status();
  if (*head_dim != std::floor(*head_dim)) {
    return Invalid(absl::StrCat(where, ".head_dim must be an integer"));
  }
  auto tflops = ReadNumber(e, "tflops", where, 0, 1e6, true);
  if (!tflops.ok()) return tflops.status();
  r.block_tokens = *block;
  r.head_dim = static_cast<int>(*head_dim);
  r.tflops = *tflops;
  if (auto s = e.find("source"); s != e.end() && s->is_string()) r.source = s->get<std::string>();
  return r;
}

absl::Status ReadPerKind(const json& j, const char* field, double low, double high, bool low_open,
                         std::map<std::string, double>* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_object()) return Invalid(absl::StrCat(field, " must be an object keyed by kind"));
  for (auto& [kind, value] : it->items()) {
    json holder = {{kind, value}};
    auto v = ReadNumber(holder, kind.c_str(), field, low, high, low_open);
    if (!v.ok()) return v.status();
    (*out)[kind] = *v;
  }
  return absl::OkStatus();
}

absl::Status ReadNetwork(const json& j, Calibration* c) {
  auto it = j.find("network");
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_object()) return Invalid("network must be an object");
  struct Field {
    const char* name;
    double low, high;
    bool low_open;
    double* out;
  };
  for (const Field& f : {Field{"step_overhead_us", 0, 1e6, false, &c->step_overhead_us},
                         Field{"link_efficiency", 0, 1, true, &c->link_efficiency},
                         Field{"half_bandwidth_kib", 0, 1e9, false, &c->half_bandwidth_kib}}) {
    if (!it->contains(f.name)) continue;
    auto v = ReadNumber(*it, f.name, "network", f.low, f.high, f.low_open);
    if (!v.ok()) return v.status();
    *f.out = *v;
  }
  return absl::OkStatus();
}

// The group a rate belongs to: (kind, engine, direction, head dim).
using GroupKey = std::tuple<std::string, std::string, bool, int>;
GroupKey KeyOf(const CalibrationRate& r) {
  return {r.device_kind, r.engine, r.backward, r.head_dim};
}

// The engines tried for a kind, in order, for the engine asked.
std::vector<std::string> EngineChain(Engine engine) {
  switch (engine) {
    case Engine::kAuto:
      return {"cudnn", "jit"};
    case Engine::kJit:
      return {"jit"};
    case Engine::kCudnn:
      return {"cudnn", "jit"};
    case Engine::kFa2:
      return {"fa2", "cudnn", "jit"};
    case Engine::kFa3:
      return {"fa3", "fa2", "cudnn", "jit"};
  }
  return {"jit"};
}

// The forward + backward rate of a forward rate f and a backward rate b.
double Combine(double f, double b) { return (1 + kBackwardFactor) / (1 / f + kBackwardFactor / b); }

}  // namespace

std::shared_ptr<AttentionRates> CalibratedRates(const Calibration& c, const std::string& kind,
                                                const std::string& engine) {
  auto rates = std::make_shared<AttentionRates>();
  rates->engine = engine;
  std::map<std::pair<bool, int>, RateCurve> curves;
  for (const CalibrationRate& r : c.rates) {
    if (r.device_kind != kind || r.engine != engine) continue;
    RateCurve& curve = curves[{r.backward, r.head_dim}];
    curve.head_dim = r.head_dim;
    curve.points.push_back({r.block_tokens, r.tflops * 1e12});
    if (rates->source.empty()) rates->source = r.source.empty() ? c.name : r.source;
  }
  for (auto& [key, curve] : curves) {
    std::sort(curve.points.begin(), curve.points.end());
    (key.first ? rates->backward : rates->forward).push_back(curve);
  }
  if (rates->forward.empty() || rates->backward.empty()) return nullptr;
  rates->forward_shape = BuiltinShape(engine, false);
  rates->backward_shape = BuiltinShape(engine, true);
  return rates;
}

const char* EngineName(Engine engine) { return kEngineNames[static_cast<int>(engine)]; }

absl::StatusOr<Engine> ParseEngine(absl::string_view name) {
  for (int i = 0; i < 5; ++i) {
    if (name == kEngineNames[i]) return static_cast<Engine>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention engine \"", name, "\"; known: auto, jit, cudnn, fa2, fa3"));
}

const Calibration& BuiltinCalibration() {
  static const Calibration* builtin = new Calibration(MakeBuiltin());
  return *builtin;
}

absl::StatusOr<Calibration> CalibrationFromJsonText(absl::string_view text) {
  absl::StatusOr<json> parsed = ParseJsonText(text);
  if (!parsed.ok()) return Invalid(std::string(parsed.status().message()));
  const json& j = *parsed;
  if (!j.is_object()) return Invalid("the text is not a JSON object");
  if (auto f = j.find("format"); f != j.end() && (!f->is_string() || *f != "hsap-calibration")) {
    return Invalid("format must be \"hsap-calibration\"");
  }
  if (auto v = j.find("version"); v != j.end() && (!v->is_number_integer() || *v != 1)) {
    return Invalid("version must be 1 (the only version this build reads)");
  }
  Calibration c;
  c.name = j.contains("name") && j["name"].is_string() ? j["name"].get<std::string>() : "file";
  c.link_efficiency = 0;  // 0: not given (OverlayCalibration keeps the base's)
  c.step_overhead_us = c.half_bandwidth_kib = -1;
  auto rates = j.find("rates");
  if (rates == j.end() || !rates->is_array() || rates->empty()) {
    return Invalid(
        "\"rates\" must be a non-empty array of {device_kind, engine, direction, "
        "block_tokens, head_dim, tflops}");
  }
  for (size_t i = 0; i < rates->size(); ++i) {
    absl::StatusOr<CalibrationRate> r = ReadRate((*rates)[i], absl::StrCat("rates[", i, "]"));
    if (!r.ok()) return r.status();
    c.rates.push_back(*r);
  }
  if (auto s = ReadPerKind(j, "gemm_efficiency", 0, 1, true, &c.gemm_efficiency); !s.ok()) {
    return s;
  }
  if (auto s = ReadPerKind(j, "nccl_compute_fraction", 0, 0.99, false, &c.nccl_compute_fraction);
      !s.ok()) {
    return s;
  }
  if (auto s = ReadNetwork(j, &c); !s.ok()) return s;
  return c;
}

Calibration OverlayCalibration(const Calibration& base, const Calibration& over) {
  Calibration c = base;
  c.name = absl::StrCat(over.name, " over ", base.name);
  std::set<GroupKey> replaced;
  for (const CalibrationRate& r : over.rates) replaced.insert(KeyOf(r));
  c.rates.clear();
  for (const CalibrationRate& r : base.rates) {
    if (!replaced.count(KeyOf(r))) c.rates.push_back(r);
  }
  for (CalibrationRate r : over.rates) {
    if (r.source.empty()) r.source = over.name;
    c.rates.push_back(r);
  }
  for (auto& [k, v] : over.gemm_efficiency) c.gemm_efficiency[k] = v;
  for (auto& [k, v] : over.nccl_compute_fraction) c.nccl_compute_fraction[k] = v;
  if (over.step_overhead_us >= 0) c.step_overhead_us = over.step_overhead_us;
  if (over.link_efficiency > 0) c.link_efficiency = over.link_efficiency;
  if (over.half_bandwidth_kib >= 0) c.half_bandwidth_kib = over.half_bandwidth_kib;
  return c;
}

absl::StatusOr<Calibration> LoadCalibrationOverBuiltin(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open calibration file ", path));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<Calibration> file = CalibrationFromJsonText(text.str());
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat(path, ": ", file.status().message()));
  }
  if (file->name == "file") file->name = path;
  return OverlayCalibration(BuiltinCalibration(), *file);
}

absl::StatusOr<Calibration> CalibrationFromEnvironment() {
  const std::string path = GetStringParam(Param::kCalibration);
  if (path.empty()) return BuiltinCalibration();
  absl::StatusOr<Calibration> c = LoadCalibrationOverBuiltin(path);
  if (!c.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "$HSAP_CALIBRATION = '", path, "' is not a usable calibration file: ", c.status().message(),
        " (the format is in lib/planner/calibration.h; unset the variable for the built-in "
        "figures)"));
  }
  return c;
}

std::string CalibrationToJsonText(const Calibration& c) {
  json rates = json::array();
  for (const CalibrationRate& r : c.rates) {
    json e = {{"device_kind", r.device_kind},
              {"engine", r.engine},
              {"direction", r.backward ? "backward" : "forward"},
              {"block_tokens", r.block_tokens},
              {"head_dim", r.head_dim},
              {"tflops", r.tflops}};
    if (!r.source.empty()) e["source"] = r.source;
    rates.push_back(e);
  }
  json j = {{"format", "hsap-calibration"}, {"version", 1}, {"name", c.name}, {"rates", rates}};
  if (!c.gemm_efficiency.empty()) j["gemm_efficiency"] = c.gemm_efficiency;
  if (!c.nccl_compute_fraction.empty()) j["nccl_compute_fraction"] = c.nccl_compute_fraction;
  json network = json::object();
  if (c.step_overhead_us >= 0) network["step_overhead_us"] = c.step_overhead_us;
  if (c.link_efficiency > 0) network["link_efficiency"] = c.link_efficiency;
  if (c.half_bandwidth_kib >= 0) network["half_bandwidth_kib"] = c.half_bandwidth_kib;
  if (!network.empty()) j["network"] = network;
  return j.dump(2);
}

double CombinedAttentionRate(const DeviceKind& kind, double block_tokens, int head_dim) {
  return Combine(kind.AttentionRate(false, block_tokens, head_dim),
                 kind.AttentionRate(true, block_tokens, head_dim));
}

double CombinedAttentionRate(const AttentionRates& rates, double block_tokens, int head_dim) {
  return Combine(rates.Rate(false, block_tokens, head_dim),
                 rates.Rate(true, block_tokens, head_dim));
}

absl::StatusOr<std::string> ApplyCalibration(const Calibration& calibration, Engine engine,
                                             Cluster* cluster) {
  std::vector<std::string> notes;
  std::set<std::string> engines_used, sources;
  for (DeviceKind& kind : cluster->kinds) {
    if (auto g = calibration.gemm_efficiency.find(kind.name);
        g != calibration.gemm_efficiency.end()) {
      kind.gemm_efficiency = g->second;
    }
    if (auto n = calibration.nccl_compute_fraction.find(kind.name);
        n != calibration.nccl_compute_fraction.end()) {
      kind.nccl_compute_fraction = n->second;
    }
    kind.rates = nullptr;
    std::shared_ptr<AttentionRates> rates;
    if (!kind.efficiency_given) {
      for (const std::string& e : EngineChain(engine)) {
        if ((rates = CalibratedRates(calibration, kind.name, e)) != nullptr) break;
      }
    }
    if (rates == nullptr) {
      notes.push_back(absl::StrCat(kind.name, ": flat ", kind.attention_efficiency, " of peak (",
                                   kind.efficiency_given ? "cluster description" : "no figures",
                                   ")"));
      engines_used.insert("flat");
      sources.insert("flat");
      continue;
    }
    kind.rates = rates;
    const double rate = CombinedAttentionRate(kind, kShareBlockTokens, kBuiltinHeadDim);
    kind.attention_efficiency = std::min(1.0, rate / kind.peak_flops);
    engines_used.insert(rates->engine);
    sources.insert(rates->source);
    notes.push_back(absl::StrCat(kind.name, ": ", rates->engine, ", ", rates->source));
  }
  cluster->step_overhead_s = calibration.step_overhead_us * 1e-6;
  // The merge reads the running fp32 output and the stage's bf16 partial, writes fp32.
  cluster->merge_bytes_per_element = 10;
  cluster->link_efficiency = calibration.link_efficiency;
  cluster->half_bandwidth_bytes = calibration.half_bandwidth_kib * 1024;
  const std::string engines =
      engines_used.size() == 1 ? *engines_used.begin() : absl::StrCat(EngineName(engine));
  if (sources.size() == 1 && *sources.begin() != "flat") {
    cluster->pricing = absl::StrCat("engine ", engines, ", calibration ", *sources.begin());
  } else {
    cluster->pricing = absl::StrCat("engine ", engines, ", calibration ", calibration.name, " (",
                                    absl::StrJoin(notes, "; "), ")");
  }
  return cluster->pricing;
}

}  // namespace hsap
