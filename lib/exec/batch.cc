#include "lib/exec/batch.h"

#include <bit>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace hsap {
namespace {

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 33);
}

// What every rank must agree on before a batch exists. Plain words, so that it travels
// through AllGather as bytes.
struct CreateRecord {
  uint64_t ok = 0;
  uint64_t num_ranks = 0;
  uint64_t layout = 0;
  uint64_t weights = 0;
  uint64_t dtype = 0;
  uint64_t heads_q = 0;
  uint64_t heads_kv = 0;
  uint64_t head_dim = 0;
  uint64_t scale = 0;
  uint64_t mode = 0;   // a CreateMode: what `weights` hashes (weights, plan or partition)
  uint64_t count = 1;  // batches created together (each field then hashes theirs, in order)
};

struct CallRecord {
  uint64_t ok = 0;
  uint64_t call = 0;
  uint64_t kind = 0;
  uint64_t batch = 0;
};

const char* KindName(uint64_t kind) { return kind == 1 ? "forward" : "backward"; }

// How a batch was created: from weights (hsapBatchCreate), under a plan
// (hsapBatchCreateWithPlan), over a given partition (hsapBatchCreateWithPartition), or as one
// of several over it (hsapBatchCreateManyWithPartition; one batch of those is kByPartition).
enum CreateMode : uint64_t { kByWeights = 0, kByPlan = 1, kByPartition = 2, kManyByPartition = 3 };

const char* CreatedWith(uint64_t mode) {
  return mode == kByPlan        ? "with a plan (hsapBatchCreateWithPlan)"
         : mode == kByPartition ? "over a partition (hsapBatchCreateWithPartition)"
         : mode == kManyByPartition
             ? "with others over a partition (hsapBatchCreateManyWithPartition)"
             : "without a plan (hsapBatchCreate)";
}

const char* InputsName(uint64_t mode) {
  return mode == kByPlan                                    ? "plan"
         : mode == kByPartition || mode == kManyByPartition ? "partition"
                                                            : "weights";
}

CreateRecord RecordOf(const Communicator& comm, const Layout& layout, uint64_t inputs,
                      const BatchOptions& options, const AttentionDims& dims, uint64_t mode,
                      bool ok) {
  CreateRecord r;
  r.ok = ok;
  r.num_ranks = static_cast<uint64_t>(comm.size());
  r.layout = layout.Fingerprint();
  r.weights = inputs;
  r.dtype = static_cast<uint64_t>(options.dtype);
  r.heads_q = static_cast<uint64_t>(options.heads_q);
  r.heads_kv = static_cast<uint64_t>(options.heads_kv);
  r.head_dim = static_cast<uint64_t>(options.head_dim);
  r.scale = std::bit_cast<uint32_t>(dims.scale);
  r.mode = mode;
  return r;
}

// The records of batches created together as one: each field hashes the batches' values in
// order (one batch: its own record, so that it agrees with CreateWithPartition's).
CreateRecord Combine(absl::Span<const CreateRecord> records) {
  if (records.size() == 1) return records[0];
  CreateRecord c = records[0];
  c.mode = kManyByPartition;
  c.count = records.size();
  uint64_t* const fields[] = {&c.layout, &c.dtype, &c.heads_q, &c.heads_kv, &c.head_dim, &c.scale};
  const uint64_t CreateRecord::*const members[] = {&CreateRecord::layout,   &CreateRecord::dtype,
                                                   &CreateRecord::heads_q,  &CreateRecord::heads_kv,
                                                   &CreateRecord::head_dim, &CreateRecord::scale};
  for (size_t f = 0; f < std::size(fields); ++f) {
    uint64_t h = 0x6d616e79u;  // "many"
    for (const CreateRecord& r : records) h = Mix(h, r.*members[f]);
    *fields[f] = h;
  }
  return c;
}

uint64_t Fingerprint(const CreateRecord& r) {
  uint64_t h = Mix(r.layout, r.weights);
  for (uint64_t v : {r.dtype, r.heads_q, r.heads_kv, r.head_dim, r.scale}) h = Mix(h, v);
  return h;
}

// The creation agreement: every rank's record, the first disagreement as FailedPrecondition
// naming the rank and the field; `local` (this rank's own failure) first.
absl::Status AgreeOn(Communicator& comm, const CreateRecord& mine, const absl::Status& local) {
  std::vector<CreateRecord> all(comm.size());
  HSAP_RETURN_IF_ERROR(comm.transport().AllGather(&mine, all.data(), sizeof(CreateRecord),
                                                  "batch creation (agreement on the inputs)"));
  if (!local.ok()) return local;
  for (int r = 0; r < comm.size(); ++r) {
    if (!all[r].ok) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r,
                       " rejected its arguments to batch creation (its own error says "
                       "why); no rank created the batch"));
    }
  }
  const CreateRecord& ref = all[0];
  for (int r = 1; r < comm.size(); ++r) {
    const CreateRecord& o = all[r];
    if (o.mode != ref.mode) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " created the batch ", CreatedWith(o.mode), " but rank 0 ",
          CreatedWith(ref.mode), "; every rank of the communicator must create it the same way"));
    }
    if (o.count != ref.count) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " created ", o.count, " batches together but rank 0 ", ref.count,
                       "; every rank must create the same batches"));
    }
    const char* what = o.layout != ref.layout       ? "layout"
                       : o.weights != ref.weights   ? InputsName(ref.mode)
                       : o.dtype != ref.dtype       ? "dtype"
                       : o.heads_q != ref.heads_q   ? "numHeadsQ"
                       : o.heads_kv != ref.heads_kv ? "numHeadsKV"
                       : o.head_dim != ref.head_dim ? "headDim"
                       : o.scale != ref.scale       ? "softmaxScale"
                                                    : nullptr;
    if (what != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, "'s ", what,
          ref.count > 1 ? absl::StrCat(" (of one of the ", ref.count, " batches, in order)") : "",
          " differs from rank 0's; every rank of the communicator must create the batch with "
          "the same layout, ",
          InputsName(ref.mode), " and config"));
    }
  }
  return absl::OkStatus();
}

// Every rank learns whether every rank prepared its runner(s) after the agreement.
absl::Status AgreePrepared(Communicator& comm, const absl::Status& local) {
  const uint64_t mine = local.ok() ? 1 : 0;
  std::vector<uint64_t> all(comm.size());
  HSAP_RETURN_IF_ERROR(comm.transport().AllGather(&mine, all.data(), sizeof(uint64_t),
                                                  "batch creation (device preparation)"));
  if (!local.ok()) return local;
  for (int r = 0; r < comm.size(); ++r) {
    if (all[r] == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r,
          " could not prepare its device for the batch (its own error says why); no rank "
          "created the batch"));
    }
  }
  return absl::OkStatus();
}

// The checks of a given partition for a batch of `layout` on `comm`.
absl::Status CheckSharedPartition(const Communicator& comm, const Layout& layout,
                                  const Partition* partition) {
  if (partition == nullptr) {
    return absl::InvalidArgumentError(
        "partition is null; pass one from hsapPartitionCreate(ForLayouts) or "
        "hsapBatchGetPartition");
  }
  if (partition->num_ranks() != comm.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition is for ", partition->num_ranks(), " ranks but the communicator has ",
        comm.size(), "; create it with nranks equal to the communicator's size"));
  }
  if (partition->num_tokens() != layout.num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition covers a row of ", partition->num_tokens(), " tokens but layout has ",
        layout.num_tokens(), "; a partition is shared only by layouts of the same row"));
  }
  return absl::OkStatus();
}

uint64_t WeightsHash(const Partition& partition) {
  uint64_t h = 0x77656967u;  // "weig"
  for (double w : partition.weights()) h = Mix(h, std::bit_cast<uint64_t>(w));
  return h;
}

}  // namespace

absl::StatusOr<AttentionDims> DimsFromOptions(const BatchOptions& o) {
  AttentionDims dims;
  if (o.heads_q <= 0 || o.heads_kv <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "numHeadsQ = ", o.heads_q, ", numHeadsKV = ", o.heads_kv, "; both must be positive"));
  }
  if (o.heads_q % o.heads_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("numHeadsQ = ", o.heads_q, " is not a multiple of numHeadsKV = ", o.heads_kv,
                     " (GQA needs whole groups of query heads per K/V head)"));
  }
  if (!std::isfinite(o.scale) || o.scale < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmaxScale = ", o.scale, "; it must be finite and positive, or 0 for 1/sqrt(headDim)"));
  }
  dims.heads_q = o.heads_q;
  dims.heads_kv = o.heads_kv;
  dims.head_dim = o.head_dim;
  dims.scale = o.scale != 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(o.head_dim));
  HSAP_RETURN_IF_ERROR(ValidateDims(dims));
  return dims;
}

std::unique_ptr<Batch> Batch::NewBatch(Communicator& comm, const BatchOptions& options,
                                       absl::Status& local) {
  std::unique_ptr<Batch> batch(new Batch());
  batch->comm_ = &comm;
  batch->options_ = options;
  if (local.ok()) {
    absl::StatusOr<AttentionDims> dims = DimsFromOptions(options);
    if (dims.ok()) {
      batch->dims_ = *std::move(dims);
    } else {
      local = dims.status();
    }
  }
  return batch;
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::Create(Communicator& comm, const Layout& layout,
                                                     absl::Span<const double> weights,
                                                     const BatchOptions& options,
                                                     const KernelSet& kernels,
                                                     absl::Status local_check) {
  return Create(comm, layout, weights, options, *HostRunners(kernels), std::move(local_check));
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::Create(Communicator& comm, const Layout& layout,
                                                     absl::Span<const double> weights,
                                                     const BatchOptions& options,
                                                     RunnerFactory& runners,
                                                     absl::Status local_check) {
  absl::Status local = local_check;
  std::shared_ptr<const Partition> partition;
  if (local.ok()) {
    absl::StatusOr<Partition> p = Partition::Create(layout, comm.size(), weights);
    if (p.ok()) {
      partition = std::make_shared<const Partition>(*std::move(p));
    } else {
      local = p.status();
    }
  }
  const uint64_t inputs = partition != nullptr ? WeightsHash(*partition) : 0;
  return CreateOverPartition(comm, layout, std::move(partition), kByWeights, inputs, options,
                             runners, std::move(local));
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::CreateWithPartition(
    Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
    const BatchOptions& options, RunnerFactory& runners, absl::Status local_check) {
  absl::Status local = local_check;
  if (local.ok()) local = CheckSharedPartition(comm, layout, partition.get());
  const uint64_t inputs = local.ok() ? partition->Fingerprint() : 0;
  if (!local.ok()) partition = nullptr;
  return CreateOverPartition(comm, layout, std::move(partition), kByPartition, inputs, options,
                             runners, std::move(local));
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::CreateWithPartition(
    Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
    const BatchOptions& options, const KernelSet& kernels, absl::Status local_check) {
  return CreateWithPartition(comm, layout, std::move(partition), options, *HostRunners(kernels),
                             std::move(local_check));
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::CreateOverPartition(
    Communicator& comm, const Layout& layout, std::shared_ptr<const Partition> partition,
    uint64_t mode, uint64_t inputs, const BatchOptions& options, RunnerFactory& runners,
    absl::Status local) {
  std::unique_ptr<Batch> batch = NewBatch(comm, options, local);
  batch->partition_ = std::move(partition);
  if (!runners.PreparesLocally()) {
    HSAP_RETURN_IF_ERROR(batch->AgreeOnCreate(layout, inputs, local, mode));
    HSAP_RETURN_IF_ERROR(batch->AgreeOnRunner(batch->Prepare(layout, runners)));
    return batch;
  }
  // The runner first: the one agreement then covers it too.
  if (local.ok()) {
    absl::StatusOr<std::unique_ptr<BatchRunner>> runner = batch->Prepare(layout, runners);
    if (runner.ok()) {
      batch->runner_ = *std::move(runner);
    } else {
      local = runner.status();
    }
  }
  HSAP_RETURN_IF_ERROR(batch->AgreeOnCreate(layout, inputs, local, mode));
  return batch;
}

absl::StatusOr<std::vector<std::unique_ptr<Batch>>> Batch::CreateManyWithPartition(
    Communicator& comm, absl::Span<const Layout* const> layouts,
    std::shared_ptr<const Partition> partition, absl::Span<const BatchOptions> options,
    absl::Span<RunnerFactory* const> runners, absl::Status local_check) {
  absl::Status local = std::move(local_check);
  const size_t n = layouts.size();
  if (local.ok() && (n == 0 || options.size() != n || runners.size() != n)) {
    local = absl::InvalidArgumentError(
        absl::StrCat(n, " layouts, ", options.size(), " configs and ", runners.size(),
                     " runner factories; pass one of each per batch, for at least one batch"));
  }
  const size_t count = local.ok() ? n : 0;
  for (size_t i = 0; i < count && local.ok(); ++i) {
    local = CheckSharedPartition(comm, *layouts[i], partition.get());
  }
  const uint64_t inputs = local.ok() ? partition->Fingerprint() : 0;
  std::vector<std::unique_ptr<Batch>> batches;
  bool early = true;  // every runner made before the agreement
  for (size_t i = 0; i < count; ++i) {
    batches.push_back(NewBatch(comm, options[i], local));
    batches.back()->partition_ = partition;
    early = early && runners[i]->PreparesLocally();
  }
  for (size_t i = 0; early && local.ok() && i < count; ++i) {
    absl::StatusOr<std::unique_ptr<BatchRunner>> runner =
        batches[i]->Prepare(*layouts[i], *runners[i]);
    if (runner.ok()) {
      batches[i]->runner_ = *std::move(runner);
    } else {
      local = runner.status();
    }
  }
  std::vector<CreateRecord> records;
  for (size_t i = 0; local.ok() && i < count; ++i) {
    records.push_back(
        RecordOf(comm, *layouts[i], inputs, options[i], batches[i]->dims_, kByPartition, true));
  }
  const CreateRecord mine = local.ok() ? Combine(records) : CreateRecord{};
  HSAP_RETURN_IF_ERROR(AgreeOn(comm, mine, local));
  for (size_t i = 0; i < count; ++i) batches[i]->fingerprint_ = Fingerprint(records[i]);
  if (early) return batches;
  // Every rank prepares every batch, in order, also after a failure of its own (the
  // factories' collectives stay in step), then one round says whether all did.
  absl::Status prepared;
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<std::unique_ptr<BatchRunner>> runner =
        batches[i]->Prepare(*layouts[i], *runners[i]);
    if (runner.ok()) {
      batches[i]->runner_ = *std::move(runner);
    } else if (prepared.ok()) {
      prepared = runner.status();
    }
  }
  HSAP_RETURN_IF_ERROR(AgreePrepared(comm, prepared));
  return batches;
}

absl::StatusOr<std::unique_ptr<BatchRunner>> Batch::Prepare(const Layout& layout,
                                                            RunnerFactory& runners) {
  Communicator& comm = *comm_;
  HSAP_ASSIGN_OR_RETURN(
      Schedule schedule,
      BuildSchedule(layout, *partition_, comm.rank(), runners.WorkBlockRows(),
                    runners.RunsRelays() ? absl::Span<const int>(comm.topology().node_of_rank())
                                         : absl::Span<const int>()));
  schedule_ = std::make_unique<const Schedule>(std::move(schedule));
  return runners.ForSchedule(comm, *schedule_, dims_, options_.dtype);
}

absl::Status Batch::AgreeOnRunner(absl::StatusOr<std::unique_ptr<BatchRunner>> runner) {
  HSAP_RETURN_IF_ERROR(AgreePrepared(*comm_, runner.status()));
  runner_ = *std::move(runner);
  return absl::OkStatus();
}

absl::Status Batch::AgreeOnCreate(const Layout& layout, uint64_t inputs, const absl::Status& local,
                                  uint64_t mode) {
  const CreateRecord mine = RecordOf(*comm_, layout, inputs, options_, dims_, mode, local.ok());
  HSAP_RETURN_IF_ERROR(AgreeOn(*comm_, mine, local));
  fingerprint_ = Fingerprint(mine);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::CreateWithPlan(Communicator& comm,
                                                             const Layout& layout, const Plan& plan,
                                                             const BatchOptions& options,
                                                             const KernelSet& kernels,
                                                             absl::Status local_check) {
  return CreateWithPlan(comm, layout, plan, options, *HostRunners(kernels), std::move(local_check));
}

absl::StatusOr<std::unique_ptr<Batch>> Batch::CreateWithPlan(Communicator& comm,
                                                             const Layout& layout, const Plan& plan,
                                                             const BatchOptions& options,
                                                             RunnerFactory& runners,
                                                             absl::Status local_check) {
  absl::Status local = local_check;
  std::unique_ptr<Batch> batch = NewBatch(comm, options, local);
  // Every rank builds the same hierarchy (which validates the plan); this rank keeps its own
  // part.
  std::optional<Hierarchy> hierarchy;
  if (local.ok()) {
    // The communicator's nodes when the runners fan out (a plan for another rank count is
    // reported below).
    const bool fan_out = runners.RunsPlanFanOuts() && plan.num_ranks == comm.size();
    absl::StatusOr<Hierarchy> h = Hierarchy::Create(
        layout, plan,
        fan_out ? absl::Span<const int>(comm.topology().node_of_rank()) : absl::Span<const int>());
    if (h.ok()) {
      hierarchy = *std::move(h);
    } else {
      local = h.status();
    }
  }
  if (local.ok() && plan.num_ranks != comm.size()) {
    local = absl::InvalidArgumentError(absl::StrCat("plan is for ", plan.num_ranks,
                                                    " ranks but the communicator has ", comm.size(),
                                                    "; build the plan for this communicator"));
  }
  if (local.ok() && (plan.heads_q != options.heads_q || plan.heads_kv != options.heads_kv)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "plan has ", plan.heads_q, " query and ", plan.heads_kv, " KV heads but the config says ",
        options.heads_q, " and ", options.heads_kv, "; they must agree"));
  }
  if (local.ok()) {
    absl::StatusOr<RankHierarchy> mine =
        hierarchy->BuildRank(layout, comm.rank(), runners.WorkBlockRows());
    if (mine.ok()) {
      batch->hierarchy_ = std::make_unique<const RankHierarchy>(*std::move(mine));
    } else {
      local = mine.status();
    }
  }
  if (local.ok()) {
    absl::StatusOr<Partition> p = Partition::FromRanges(layout, hierarchy->shards());
    if (p.ok()) {
      batch->partition_ = std::make_shared<const Partition>(*std::move(p));
    } else {
      local = p.status();
    }
  }
  const uint64_t plan_hash = local.ok() ? plan.Fingerprint() : 0;
  HSAP_RETURN_IF_ERROR(batch->AgreeOnCreate(layout, plan_hash, local, kByPlan));
  HSAP_RETURN_IF_ERROR(batch->AgreeOnRunner(
      runners.ForHierarchy(comm, *batch->hierarchy_, batch->dims_, options.dtype)));
  return batch;
}

absl::Status Batch::AgreeOnCall(uint64_t kind, const absl::Status& local_check) {
  const uint64_t call = calls_++;
  CallRecord mine{local_check.ok() ? 1u : 0u, call, kind, fingerprint_};
  std::vector<CallRecord> all(comm_->size());
  HSAP_RETURN_IF_ERROR(comm_->transport().AllGather(
      &mine, all.data(), sizeof(CallRecord),
      absl::StrCat(KindName(kind), " (call ", call, " of the batch: agreement)")));
  if (!local_check.ok()) return local_check;
  for (int r = 0; r < comm_->size(); ++r) {
    const CallRecord& o = all[r];
    if (!o.ok) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " rejected its arguments to this ", KindName(kind),
                       " (its own error says why); no rank computed it"));
    }
    if (o.batch != fingerprint_) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " called ", KindName(o.kind), " on a different batch than rank ",
                       comm_->rank(), "; all ranks must make the same calls in the same order"));
    }
    if (o.kind != kind || o.call != call) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " called ", KindName(o.kind), " as call ", o.call,
          " of this batch while rank ", comm_->rank(), " called ", KindName(kind), " as call ",
          call, "; all ranks must make the same calls in the same order"));
    }
  }
  return absl::OkStatus();
}

absl::Status Batch::Forward(const void* q, const void* k, const void* v, void* out, float* lse,
                            absl::Status local_check, void* stream) {
  const uint64_t call = calls_;
  HSAP_RETURN_IF_ERROR(AgreeOnCall(1, local_check));
  runner_->set_call_stream(stream);
  return runner_->Forward(call, q, k, v, out, lse, traffic_.forward);
}

absl::Status Batch::Backward(const void* dout, const void* q, const void* k, const void* v,
                             const void* out, const float* lse, void* dq, void* dk, void* dv,
                             absl::Status local_check, void* stream) {
  const uint64_t call = calls_;
  HSAP_RETURN_IF_ERROR(AgreeOnCall(2, local_check));
  runner_->set_call_stream(stream);
  return runner_->Backward(call, dout, q, k, v, out, lse, dq, dk, dv, traffic_.backward);
}

absl::StatusOr<LinkTraffic> Batch::Links(const CallTraffic& call) const {
  if (call.links_counted) return call.links;
  // A pass not run yet (e.g. forward only) moved nothing, on any link.
  if (call.sent() == 0 && call.received() == 0) return LinkTraffic{};
  if (!comm_->topology().single_node()) {
    return absl::UnimplementedError(
        "this batch's runner (a GPU batch) does not classify its messages by "
        "link, and the communicator's ranks span several nodes");
  }
  LinkTraffic links;
  links.intra_node_sent = call.sent();
  links.intra_node_received = call.received();
  return links;
}

}  // namespace hsap
