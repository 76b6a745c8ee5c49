// Plain data shared by host and device code: constants, the workspace view passed to every kernel, and the
// records the kernels keep in device and host-mapped memory. Host-compilable (no device code).
#pragma once

#include <cstdint>

namespace sgl_sm120 {

// The world sizes the kernels are instantiated for (1: a no-op), and the cluster sizes the fused one-shot launches
// (sgl_kernel_sm120/policy.py WORLD_SIZES, CLUSTER_SIZES; tests/test_policy.py holds them to these).
constexpr int kWorldSizes[] = {1, 2, 4, 8};
constexpr int kClusterSizes[] = {2, 4, 8};
constexpr int kMaxWorld = 8;
constexpr int kMaxCluster = 8;  // per-cluster-size arrays are indexed by the size
constexpr bool is_world_size(long long world) {
  for (int w : kWorldSizes)
    if (w == world) return true;
  return false;
}

constexpr int kPackBytes = 16;      // one vector store: 8 x 16-bit elements
constexpr int kElemsPerPack = 8;
constexpr long long kCtrlBytes = 4096;  // head of the slab: Ctrl, never IPC-written by peers
constexpr uint32_t kEmptyHalf = 0x8000u;
constexpr uint32_t kEmptyWord = 0x80008000u;
// Hierarchical schedules hand packs to owners in blocks of this many consecutive packs (512 B): a warp's 32
// lanes then store one contiguous 512 B piece per destination, the size at which a PCIe write is efficient,
// rather than 16 B pieces at a stride.
constexpr int kOwnerBlockPacks = 32;
constexpr int kOwnerBlockShift = 5;

// The data-path probe's outcome (probe.cu) per peer and kind (0: writes from the peer, 1: this rank's loads from it):
// the worst ProbeOutcome (atomicMax; 0: every place fine) and the lowest slab offset of a failed place (atomicMin;
// all ones: none). Only the probe kernel writes them, before the first call; the host resets them per probe.
constexpr int kProbeKinds = 2;
struct ProbeOutcomes {
  int outcome[kMaxWorld][kProbeKinds];
  unsigned long long failed_at[kMaxWorld][kProbeKinds];
};

// Local-only control block at the start of each rank's slab.
// The call sequence number (I5) is kept once per possible CTA index: CTA b reads seq[b] at entry and, at
// exit, writes seq + 1 into every slot b + k * gridDim below num_counters. So all slots hold the same value
// after every call whatever its grid size, no CTA reads a slot another CTA of the same call writes, and no
// atomic (whose return the CTA would have to wait for) is needed.
constexpr int kMaxCounters = 256;  // >= SM count of every supported GPU; the grid never exceeds it
struct Ctrl {
  unsigned long long seq[kMaxCounters];  // number of calls completed on this workspace (I5)
  unsigned int report_claim;              // first timed-out thread claims the report (I7)
  unsigned int poisoned;                  // 1 once a wait of this workspace timed out (I7): later calls do nothing
  unsigned long long slow_reported;       // seq + 1 of the latest call reported slow (I9), atomicMax'ed
  ProbeOutcomes probe;
};
static_assert(sizeof(Ctrl) <= 4096, "Ctrl must fit in kCtrlBytes");

// How the data of a call travels (sgl_kernel_sm120/policy.py Transport mirrors the codes; append-only):
// push: every rank stores its packs into its peers' scratch at once (csrc/ar_kernels.cu, ar_protocol.cuh I1-I13);
// staged: the same stores in W-1 permutation passes, one destination per pass, paced by flags
// (transports/staged_push.cuh); pull: every rank stores into its own slab and the peers load from it, readiness
// by flags (transports/pull.cuh).
enum Transport : int { kTransportPush = 0, kTransportStaged = 1, kTransportPull = 2 };

// Slab layout, every rank alike: [Ctrl][flags][push region, parity 0][parity 1][pull area, parity 0][parity 1].
// Flags: one 64-bit word per (call parity, phase, source rank, CTA index), the parity outermost (flag_index in
// ar_protocol.cuh), written by the source (remote store) and read by the slab's owner only; a word holds the call
// counter (seq + 1) of the latest call of its parity that the source published in that phase, so it only grows
// and never needs resetting, and a wait compares it with its own call's counter for equality (transports/pull.cuh
// P3 says why one word per parity makes that exact).
enum FlagPhase : int { kFlagOneShot = 0, kFlagReduceScatter = 1, kFlagCrossIsland = 2, kFlagAllGather = 3 };
constexpr int kFlagPhases = 4;
constexpr int kFlagParities = 2;
constexpr long long kFlagBytes =
    static_cast<long long>(kFlagParities) * kFlagPhases * kMaxWorld * kMaxCounters * 8;  // 128 KiB
constexpr long long kRegionsOffset = kCtrlBytes + kFlagBytes;

// Host-mapped (cudaHostAllocMapped) so the CPU can read it after the kernel traps and the context is gone.
struct ErrorRecord {
  int flag;  // 1 once written
  int rank;
  int peer;
  int phase;
  long long seq;
  long long waited_ns;
};

// Host-mapped report of a slow wait (I9), which is not an error: a peer may be late (lazy compilation in its
// first forward) without being dead. The first thread of a call to wait longer than warn_ns writes the fields,
// then `call_plus_one` last behind a system fence, so a reader that sees the same call_plus_one before and
// after reading the fields has read one report whole.
struct SlowRecord {
  long long call_plus_one;  // seq + 1 of the reported call; 0 = nothing reported yet
  int rank;
  int peer;
  int phase;
  int pad;
  long long waited_ns;
};

// Both host-mapped records, and the mirror of the call counter, live in one cudaHostAllocMapped block. The mirror:
// CTA 0 of every call stores its seq + 1 there as it finishes (ar_protocol.cuh finish_call), so the host reads the
// calls completed with a plain load, no stream and no copy (the server's counters and its monitoring thread).
struct HostRecords {
  ErrorRecord error;
  SlowRecord slow;
  unsigned long long calls_completed;
};

// Outcome of the data-path probe (probe.cu) for one peer, as this rank saw it: what arrived from that peer (its
// writes), and what this rank's loads from that peer returned. Worse is larger (the probe keeps the worst of each
// kind's places); sgl_kernel_sm120/data_path_probe.py names each.
enum ProbeOutcome : int {  // 0: every place of that kind was fine
  kProbeMissing = 2,
  kProbeWrong = 3,
  kProbeReadMissing = 4,
  kProbeReadWrong = 5
};

enum Phase : int { kPhaseOneShot = 1, kPhaseReduceScatter = 2, kPhaseCrossIsland = 3, kPhaseAllGather = 4 };

// Rank placement for the hierarchical schedule: `num_islands` islands of `island_size` ranks each.
// The flat two-shot schedule is the special case of one island holding every rank.
struct Topology {
  int island_size;                 // 1, 2, 4 or 8 (the kernels are instantiated per size)
  int num_islands;
  int my_island;
  int my_index;                    // position of this rank inside its island
  int island_ranks[kMaxWorld];     // ranks of this rank's island, by position
  int twin_ranks[kMaxWorld];       // rank at this rank's position in island g, by g
};

// Everything a kernel needs to find scratch; passed by value, identical for every call of a workspace.
struct WorkspaceView {
  char* bases[kMaxWorld];  // slab base of each rank, mapped into this process (own slab included)
  int rank;
  int world;
  long long region_bytes;      // bytes of one parity region (push)
  long long oneshot_slot_bytes;  // one-shot: one slot per sender, max payload each
  long long chunk_slot_bytes;    // hierarchical: one slot per sender, one owner's share of the max payload
  long long pull_offset;         // slab offset of the pull areas (after both push regions)
  long long pull_region_bytes;   // one parity's pull area: [input copy: max payload][partial: 2 chunks][result: chunk]
  long long pull_input_bytes;    // the input copy's bytes (the largest payload)
  Ctrl* ctrl;
  ErrorRecord* error;  // device pointer of the host-mapped record
  SlowRecord* slow;    // device pointer of the host-mapped slow-wait report (I9)
  unsigned long long* calls_completed;  // device pointer of the host-mapped mirror of seq (HostRecords)
  long long timeout_ns;
  long long warn_ns;   // a wait this long is reported (I9); capped at timeout_ns by the host
  int num_counters;  // seq slots in use: the workspace's largest grid (<= kMaxCounters)
  int host_memory;   // 1: the slabs are in shared pinned host memory (no P2P), see I11
  int trap_on_timeout;  // I7: 1 = trap (the CUDA context ends), 0 = record, poison the workspace and return
  Topology flat;
  Topology islands;
};

}  // namespace sgl_sm120
