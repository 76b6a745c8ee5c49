// Host-side interface of the CUDA sources: kernel launches and the IPC workspace. Plain CUDA runtime types
// only (no torch), so csrc/*.cu compiles with nvcc alone; torch_bindings.cpp adapts it to torch ops.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "ar_types.h"

namespace sgl_sm120 {

// The schedule of a call. sgl_kernel_sm120/policy.py Schedule mirrors the codes (append-only; kernel_limits()
// reports them and the Python side refuses a library whose codes differ).
enum class Schedule : int { kOneShot = 0, kTwoShot = 1, kIsland = 2 };
enum class ElemType : int { kBFloat16 = 0, kFloat16 = 1 };

// How a call launches. Every field is the same on every rank of the group (the group agrees the CTA budget, the
// cluster mask and the capacities at construction, Workspace::limits), so every rank launches the same grid.
struct LaunchShape {
  int threads;  // plain kernels: threads per CTA (the fused kernels size their own)
  int ctas;     // the CTA cap: at most this many CTAs (<= the smallest SM count of the group, I8)
  bool pdl;        // launch with programmatic stream serialization
  int cluster = 0;  // fused one-shot: CTAs per row (1, 2, 4, 8); 0 = fused_cluster_size's choice
  int cluster_mask = 0;  // bit c set: clusters of c CTAs may be launched; else the grouped one-CTA kernel runs
  int transport = kTransportPush;  // ar_types.h Transport: how the call's data travels
  int cluster_capacity[kMaxCluster + 1] = {};  // [c]: clusters of c CTAs every GPU of the group holds at once (I8)
  int window = 0;  // staged push: passes in flight before their pacing waits, 1 .. W-1; 0 = kDefaultStagedWindow
};

// The staged passes' window when a call gives none (transports/staged_push.cuh S3): every pass in flight (the
// kernels clamp it to a phase's passes), the fastest measured window (docs/design.md); the tuner also times one
// pass at a time, for the fabrics where the pacing pays.
constexpr int kDefaultStagedWindow = kMaxWorld - 1;

// Plain kernels run at most this many threads per CTA, so a thread has 128 registers (the 8-rank waits hold
// 8 packs at once, ar_protocol.cuh I10).
constexpr int kPlainMaxThreads = 512;
// The fused kernels give a row one CTA (or one cluster). A row of at most kFusedMaxThreads packs gets one pack per
// thread (64 registers a thread); wider rows, and the hierarchical kernels, run kWideThreads-thread CTAs (128
// registers) with up to kMaxPacksPerThread packs per thread.
constexpr int kFusedMaxThreads = 1024;
constexpr int kWideThreads = 512;
constexpr int kMaxPacksPerThread = 16;
constexpr int kMaxFusedHidden = kMaxPacksPerThread * kWideThreads * kElemsPerPack;
// A row split over a cluster holds at most this many packs, one per thread (hidden 8192).
constexpr int kMaxClusterRowPacks = kFusedMaxThreads;

// CTAs per row of the fused one-shot kernel (ar_kernels.cu): a pure function of group-identical values, the call's
// CTA cap and the group's cluster capacities (capacity[c] for c in kClusterSizes; 0 or nullptr: no cluster launch,
// no bound).
int fused_cluster_size(int rows, int packs_per_row, int ctas, const int* capacity);

// I8 for the cluster kernel on `device`: clusters of `cluster` CTAs (kClusterSizes) it holds at once; 0 where the
// device cannot launch clusters (cudaDevAttrClusterLaunch is 0).
cudaError_t query_cluster_capacity(int device, int world, int cluster, int* clusters);

// A constant list as an error message names it: "1, 2, 4, 8".
template <size_t N>
std::string listed(const int (&values)[N]) {
  std::string text;
  for (int v : values) text += (text.empty() ? "" : ", ") + std::to_string(v);
  return text;
}

// The grids the launches use, host-callable so that tests/launch_grid_check.cu can hold sgl_kernel_sm120/policy.py's
// copies (plain_grid, fused_grid) to them. Every input is group-identical, so every rank launches the same grid.
constexpr int round_up_warp(long long n) { return static_cast<int>((n + 31) / 32 * 32); }

struct Grid {
  int blocks;
  int threads;
};

// A plain call: a CTA no wider than kPlainMaxThreads nor than the packs rounded up to a warp, one CTA per that many
// packs, at most `ctas` of them (threads loop over the rest).
constexpr Grid plain_grid(long long num_packs, int threads, int ctas) {
  const int t = static_cast<int>(threads < kPlainMaxThreads ? threads : kPlainMaxThreads);
  const int width = round_up_warp(num_packs) < t ? round_up_warp(num_packs) : t;
  const long long wanted = (num_packs + width - 1) / width;
  const long long blocks = wanted < ctas ? wanted : ctas;
  return {static_cast<int>(blocks < 1 ? 1 : blocks), width};
}

// A fused call with a CTA per row (rows loop past `ctas`).
constexpr int fused_row_grid(int rows, int ctas) {
  const int blocks = rows < ctas ? rows : ctas;
  return blocks < 1 ? 1 : blocks;
}

// A fused one-shot call with each row over a cluster of `cluster` CTAs: one cluster per row, as many as fit the CTA
// cap and as every GPU of the group holds at once (`capacity`, I8); rows loop past that. 0: not one cluster fits.
constexpr int fused_cluster_grid(int rows, int cluster, int ctas, int capacity) {
  const int fit = ctas / cluster < capacity ? ctas / cluster : capacity;
  return fit < 1 ? 0 : (rows < fit ? rows : fit) * cluster;
}

cudaError_t launch_all_reduce(const WorkspaceView& ws, Schedule schedule, ElemType type, const void* inp, void* out,
                              long long numel, const LaunchShape& shape, cudaStream_t stream);

cudaError_t launch_all_reduce_add_rmsnorm(const WorkspaceView& ws, Schedule schedule, ElemType type, const void* inp,
                                          const void* residual, const void* weight, void* norm_out,
                                          void* residual_out, int rows, int hidden, float eps,
                                          const LaunchShape& shape, cudaStream_t stream);

// One rank's share of the IPC workspace: its slab (plain cudaMalloc, so legacy IPC export works whatever the
// torch allocator settings), the peers' slabs once opened, and the host-mapped error record.
// Where the scratch lives. kDevice: each rank's slab in its own GPU memory, peers reach it through CUDA IPC
// and P2P. kHost (no P2P, e.g. GeForce): all slabs in one POSIX shared-memory buffer, pinned and mapped into
// every rank's device address space; pushes and polls cross PCIe to host memory (ar_protocol.cuh I11).
enum class Memory : int { kDevice = 0, kHost = 1 };

// I6 (ar_protocol.cuh states the rule): what a workspace remembers of its calls' streams.
struct StreamOrder {
  cudaStream_t eager = nullptr;  // the stream of the latest eager call
  bool has_eager = false;
  bool fast = false;                // the next call from `eager` skips the slow path (no captured call seen since)
  cudaStream_t captured = nullptr;  // the stream of the latest captured call seen, and its capture (0: none)
  unsigned long long capture = 0;
};

// What a call from a stream does (I6): go; go after everything issued so far on `after`; be refused (an eager call
// while `after`, the previous eager call's stream, captures); or kUnknown: CUDA could not say whether `after`
// captures. `next`: the record once the call is made.
struct StreamStep {
  enum Kind { kGo, kOrderAfter, kRefuse, kUnknown } kind;
  cudaStream_t after;
  StreamOrder next;
};
constexpr unsigned long long kCaptureUnknown = ~0ull;

// I6's rule, pure: `capture_of(s)` is the capture stream s is in (0: none, kCaptureUnknown: CUDA cannot say). The
// fast path is one comparison. workspace.cu asks CUDA and applies the step; tests/stream_order_check.cu walks
// SGLang's sequences of streams through it on the host.
template <typename CaptureOf>
StreamStep stream_step(const StreamOrder& order, cudaStream_t stream, CaptureOf capture_of) {
  StreamStep step{StreamStep::kGo, nullptr, order};
  if (order.fast && stream == order.eager) return step;
  const unsigned long long capture = capture_of(stream);
  if (capture == kCaptureUnknown) return {StreamStep::kUnknown, stream, order};
  const bool other_eager = order.has_eager && order.eager != stream;
  const unsigned long long eager_capture = other_eager ? capture_of(order.eager) : 0;
  if (eager_capture == kCaptureUnknown) return {StreamStep::kUnknown, order.eager, order};
  if (capture != 0) {
    // Captured: ordered after the previous captured call of this capture when that came from another stream. That
    // call's stream is the latest captured one seen, or the eager stream when it captures in this capture too (a
    // captured call from the eager stream takes the fast path, unseen).
    cudaStream_t previous = stream;
    if (order.capture == capture) previous = order.captured;
    else if (eager_capture == capture) previous = order.eager;
    if (previous != stream) step = {StreamStep::kOrderAfter, previous, order};
    step.next.captured = stream;
    step.next.capture = capture;
    step.next.fast = false;  // every captured call takes the slow path, so the next one sees this one
    return step;
  }
  if (other_eager) {
    if (eager_capture != 0) return {StreamStep::kRefuse, order.eager, order};
    step = {StreamStep::kOrderAfter, order.eager, order};
  }
  step.next.eager = stream;
  step.next.has_eager = true;
  step.next.fast = true;
  return step;
}

// The group-agreed launch limits of a workspace (LaunchShape's agreed fields): until the group has agreed, the
// safe defaults (this GPU's SMs, no clusters: the grouped kernel computes the cluster kernel's bits).
struct LaunchLimits {
  int sm_budget = 0;
  int cluster_mask = 0;
  int cluster_capacity[kMaxCluster + 1] = {};
};

struct Workspace {
  int device = -1;
  int sm_count = 0;
  long long max_numel = 0;
  int cluster_capacity[kMaxCluster + 1] = {};  // this GPU's answer of query_cluster_capacity, per cluster size
  LaunchLimits limits;
  long long slab_bytes = 0;
  char* local = nullptr;  // kDevice: this rank's slab (Ctrl + scratch); kHost: only the Ctrl (device memory)
  bool peer_opened[kMaxWorld] = {};
  HostRecords* host_records = nullptr;  // host-mapped: the timeout record (I7) and the slow-wait report (I9)
  Memory memory = Memory::kDevice;
  // kHost: the shared buffer (world slabs of slab_bytes), its name and whether this rank created it
  char* shared = nullptr;
  long long shared_bytes = 0;
  bool shared_registered = false;
  std::string shared_name;  // the file's path
  bool shared_owner = false;
  bool shared_linked = false;  // the file still exists (the creator unlinks it once every rank mapped it)
  int numa_node = -1;          // kHost: the NUMA node of this GPU (-1: unknown)
  bool numa_bound = false;     // kHost: this rank's slab prefers that node (mbind accepted)
  // Loopback (benchmarks only): one process plays rank 0 of `world`; the peers' slabs are local allocations.
  bool loopback = false;
  char* loopback_slabs[kMaxWorld] = {};
  StreamOrder streams;                // I6
  cudaEvent_t order_event = nullptr;  // I6: orders a call after another stream's
  WorkspaceView view{};
};

struct WorkspaceConfig {
  int device;
  int rank;
  int world;
  long long max_numel;  // elements of 2 bytes
  long long oneshot_max_numel;  // the largest one-shot call (<= max_numel): the one-shot slots are sized by it
  long long timeout_ns;
  long long warn_ns;
  Topology flat;
  Topology islands;  // num_islands == 0: none
  Memory memory = Memory::kDevice;
  bool trap_on_timeout = true;  // I7: trap, or record, poison and return
  std::string shared_dir;      // kHost: the folder of the shared file (a tmpfs: /dev/shm by default)
  std::string shared_name;     // kHost: its name (no '/'), the same on every rank
  bool shared_create = false;  // kHost: this rank (one per group) creates it; the others open it after
};

// Each returns an empty string on success, else what failed (the binding raises it).
// kHost: creates (cfg.shared_create) or opens the shared file, maps it, and allocates and fills THIS rank's slab
// (posix_fallocate: a full tmpfs is an error here, not a SIGBUS later, and *out_of_space says it was that; pages on
// this GPU's NUMA node where the kernel allows it); the whole buffer is pinned by workspace_register_shared once
// every rank has its slab.
std::string workspace_create(const WorkspaceConfig& cfg, Workspace** out, bool* out_of_space);
// kHost, after every rank's workspace_create: pin the shared buffer and map it into the device's address space.
std::string workspace_register_shared(Workspace* ws);
// Bytes of the shared host-memory buffer a group of `world` ranks needs (every slab; the same arithmetic as
// workspace_create), for the size check and the doctor.
long long host_shared_bytes(int world, long long max_numel, long long oneshot_max_numel);
// Benchmarks only: rank 0 of `world` with every peer's slab a local allocation (no IPC, no peer process).
std::string workspace_create_loopback(int device, int world, long long max_numel, Workspace** out);
// Loopback: write a ready pattern over this rank's whole scratch on `stream`, so every peer pack reads as
// arrived (the calls empty what they read, so the benchmark refills before each call).
std::string workspace_loopback_refill(Workspace* ws, cudaStream_t stream);
// Tests and benchmarks: the workspaces of ranks 0..world-1, all in this process on one device, see each other's
// slabs directly (no IPC): one process runs the whole group, its ranks' kernels concurrently.
std::string workspace_link_local(Workspace** group, int world);
// kHost: removes the shared buffer's name once every rank has mapped it (the memory stays until all unmap).
std::string workspace_unlink_shared(Workspace* ws);
std::string workspace_ipc_handle(const Workspace* ws, cudaIpcMemHandle_t* handle);
std::string workspace_open_peers(Workspace* ws, const cudaIpcMemHandle_t* handles);
// Unmaps the peers' slabs (idempotent). Close protocol: every rank closes its imports, the group confirms it
// (a barrier on the host), and only then does each rank free its own slab, so no rank frees memory that a
// peer still maps (freeing an exported allocation that is still imported elsewhere is undefined in CUDA).
std::string workspace_close_peers(Workspace* ws);
std::string workspace_destroy(Workspace* ws);
// The data-path probe (probe.cu, P1-P5), run once after the peers are open and before the first call, in one round:
// every rank writes a pattern pack into every page of every peer's slab and waits for every peer's in its own, and
// stages packs in its own pull area that every peer loads. `out` gets, per peer, what arrived from it and what its
// loads returned, with the lowest failed slab offset of each (probe_place_name names it). drop_peer / drop_mode: the
// tests' debug switch (-1 / 0: none). Waits for the probe on the legacy default stream, not for the whole device.
std::string workspace_probe(Workspace* ws, long long timeout_ns, int drop_peer, int drop_mode, ProbeOutcomes* out);
std::string probe_place_name(const WorkspaceView& view, long long slab_offset);
// Synchronizes the device; counts 16-bit words of both parity regions that are not empty (I1, I4).
std::string workspace_dirty_halves(const Workspace* ws, long long* count);
// The negative control of the cluster check (sgl_kernel_sm120/cluster_check.py): launches a kernel that traps.
std::string launch_debug_trap(cudaStream_t stream);
// Calls completed, from the host-mapped mirror of the device's call counter (finish_call): a plain load, no CUDA
// call, safe while kernels run and after a trap.
unsigned long long workspace_calls_completed(const Workspace* ws);
// Empty while this process's CUDA context still runs work, else its error (a trap ends the context).
std::string workspace_context_error(const Workspace* ws);

// I6 where a call is made: the call's stream is the previous eager call's (one comparison), or the slow path
// orders it (workspace.cu workspace_change_stream; ar_protocol.cuh says the rule). Empty, or why it is refused.
std::string workspace_change_stream(Workspace* ws, cudaStream_t stream);
inline std::string workspace_enter_stream(Workspace* ws, cudaStream_t stream) {
  return ws->streams.fast && stream == ws->streams.eager ? std::string() : workspace_change_stream(ws, stream);
}

}  // namespace sgl_sm120
