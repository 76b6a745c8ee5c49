// torch ops of sgl_kernel_sm120: a workspace is an opaque int64 handle owned by the Python class IpcAllReduce,
// which does the collective steps (handle exchange, joint error checks) over its group's exchange.
// The checks that decide memory safety (dtype, contiguity, sizes, alignment, a usable workspace) are made here
// whoever calls, so a direct call of an op can never write out of bounds; the Python side checks first and
// explains.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ar_launch.h"

namespace sgl_sm120 {
namespace {

Workspace* as_workspace(int64_t handle) {
  TORCH_CHECK(handle != 0, "sgl_kernel_sm120: workspace handle is null (closed?)");
  return reinterpret_cast<Workspace*>(handle);
}

void check_ok(const std::string& err) { TORCH_CHECK(err.empty(), "sgl_kernel_sm120: ", err); }

void check_world(int64_t world) {
  TORCH_CHECK(is_world_size(world), "sgl_kernel_sm120: world must be one of ", listed(kWorldSizes), ", got ", world);
}

// Per-cluster-size lists cross the op boundary in the order of kClusterSizes.
constexpr size_t kNumClusterSizes = sizeof(kClusterSizes) / sizeof(kClusterSizes[0]);

Topology make_topology(const std::vector<int64_t>& island_ranks, const std::vector<int64_t>& twin_ranks,
                       int64_t my_island, int64_t my_index) {
  Topology t{};
  t.island_size = static_cast<int>(island_ranks.size());
  t.num_islands = static_cast<int>(twin_ranks.size());
  TORCH_CHECK(t.island_size <= kMaxWorld && t.num_islands <= kMaxWorld, "topology larger than kMaxWorld ranks");
  t.my_island = static_cast<int>(my_island);
  t.my_index = static_cast<int>(my_index);
  for (int i = 0; i < t.island_size; ++i) t.island_ranks[i] = static_cast<int>(island_ranks[i]);
  for (int i = 0; i < t.num_islands; ++i) t.twin_ranks[i] = static_cast<int>(twin_ranks[i]);
  return t;
}

// flat_* describe the one-island (two-shot) placement; isl_* the island placement (empty lists: none).
int64_t ws_create(int64_t device, int64_t rank, int64_t world, int64_t max_numel, int64_t oneshot_max_numel,
                  double timeout_s, double warn_s, bool trap_on_timeout, std::vector<int64_t> flat_island_ranks,
                  std::vector<int64_t> flat_twin_ranks, int64_t flat_my_island, int64_t flat_my_index,
                  std::vector<int64_t> isl_island_ranks, std::vector<int64_t> isl_twin_ranks, int64_t isl_my_island,
                  int64_t isl_my_index, int64_t memory, std::string shared_dir, std::string shared_name,
                  bool shared_create) {
  WorkspaceConfig cfg{};
  TORCH_CHECK(memory == 0 || memory == 1, "sgl_kernel_sm120: memory must be 0 (device) or 1 (host)");
  cfg.memory = static_cast<Memory>(memory);
  cfg.shared_dir = shared_dir;
  cfg.shared_name = shared_name;
  cfg.shared_create = shared_create;
  cfg.trap_on_timeout = trap_on_timeout;
  cfg.device = static_cast<int>(device);
  cfg.rank = static_cast<int>(rank);
  cfg.world = static_cast<int>(world);
  cfg.max_numel = max_numel;
  cfg.oneshot_max_numel = oneshot_max_numel;
  TORCH_CHECK(timeout_s > 0 && timeout_s < 9e9 && warn_s > 0, "sgl_kernel_sm120: timeout_s and warn_s must be > 0");
  cfg.timeout_ns = static_cast<long long>(timeout_s * 1e9);
  cfg.warn_ns = static_cast<long long>(std::min(warn_s, timeout_s) * 1e9);
  cfg.flat = make_topology(flat_island_ranks, flat_twin_ranks, flat_my_island, flat_my_index);
  cfg.islands = make_topology(isl_island_ranks, isl_twin_ranks, isl_my_island, isl_my_index);
  Workspace* ws = nullptr;
  bool out_of_space = false;
  const std::string err = workspace_create(cfg, &ws, &out_of_space);
  // A full tmpfs is torch.OutOfMemoryError, so the caller knows it by its type (construction.py), not its words.
  TORCH_CHECK_WITH(OutOfMemoryError, !out_of_space, "sgl_kernel_sm120: ", err);
  check_ok(err);
  return reinterpret_cast<int64_t>(ws);
}

// Benchmarks only (benchmarks/bench_transports.py): see workspace_create_loopback.
int64_t ws_create_loopback(int64_t device, int64_t world, int64_t max_numel) {
  Workspace* ws = nullptr;
  check_ok(workspace_create_loopback(static_cast<int>(device), static_cast<int>(world), max_numel, &ws));
  return reinterpret_cast<int64_t>(ws);
}

void ws_loopback_refill(int64_t handle) {
  Workspace* ws = as_workspace(handle);
  const c10::cuda::CUDAGuard guard(ws->device);
  check_ok(workspace_loopback_refill(ws, c10::cuda::getCurrentCUDAStream().stream()));
}

void ws_unlink_shared(int64_t handle) { check_ok(workspace_unlink_shared(as_workspace(handle))); }

void ws_register_shared(int64_t handle) { check_ok(workspace_register_shared(as_workspace(handle))); }

// Tests and benchmarks: link the workspaces of ranks 0..W-1 created in this process (see workspace_link_local).
void ws_link_local(std::vector<int64_t> handles) {
  check_world(static_cast<int64_t>(handles.size()));
  std::vector<Workspace*> group;
  for (int64_t h : handles) group.push_back(as_workspace(h));
  check_ok(workspace_link_local(group.data(), static_cast<int>(group.size())));
}

// Bytes of the shared host-memory buffer (every rank's slab) for these arguments: pure arithmetic, no GPU needed.
int64_t host_shared_bytes_for(int64_t world, int64_t max_numel, int64_t oneshot_max_numel) {
  check_world(world);
  TORCH_CHECK(max_numel > 0 && max_numel % kElemsPerPack == 0 && oneshot_max_numel > 0 &&
                  oneshot_max_numel % kElemsPerPack == 0 && oneshot_max_numel <= max_numel,
              "max_numel and oneshot_max_numel must be positive multiples of ", kElemsPerPack,
              ", oneshot_max_numel <= max_numel");
  return host_shared_bytes(static_cast<int>(world), max_numel, oneshot_max_numel);
}

// query_cluster_capacity for kClusterSizes without a workspace (the doctor).
std::vector<int64_t> cluster_capacity_for(int64_t device, int64_t world) {
  check_world(world);
  std::vector<int64_t> out;
  for (int c : kClusterSizes) {
    int clusters = 0;
    const cudaError_t err = query_cluster_capacity(static_cast<int>(device), static_cast<int>(world), c, &clusters);
    TORCH_CHECK(err == cudaSuccess, "querying cluster capacity: ", cudaGetErrorString(err));
    out.push_back(clusters);
  }
  return out;
}

// kHost: [NUMA node of this GPU (-1 unknown), 1 if this rank's slab prefers it].
std::vector<int64_t> ws_host_numa(int64_t handle) {
  const Workspace* ws = as_workspace(handle);
  return {ws->numa_node, ws->numa_bound ? 1 : 0};
}

// This GPU's cluster capacities per cluster size (0: cannot launch clusters of that size).
std::vector<int64_t> ws_cluster_capacity(int64_t handle) {
  const Workspace* ws = as_workspace(handle);
  std::vector<int64_t> out;
  for (int c : kClusterSizes) out.push_back(ws->cluster_capacity[c]);
  return out;
}

// Installs the group-agreed launch limits (the same on every rank): the SM budget and, per cluster size, how many
// clusters may run at once (0: that size is not launched; the grouped kernel computes its bits).
void ws_set_launch_limits(int64_t handle, int64_t sm_budget, std::vector<int64_t> cluster_capacity) {
  Workspace* ws = as_workspace(handle);
  TORCH_CHECK(sm_budget >= 1 && sm_budget <= ws->view.num_counters,
              "sm_budget must be in [1, this GPU's SM count (", ws->view.num_counters, ")]");
  TORCH_CHECK(cluster_capacity.size() == kNumClusterSizes, "cluster_capacity lists one capacity per cluster size");
  LaunchLimits limits;
  limits.sm_budget = static_cast<int>(sm_budget);
  for (size_t i = 0; i < kNumClusterSizes; ++i) {
    const int c = kClusterSizes[i];
    TORCH_CHECK(cluster_capacity[i] >= 0 && cluster_capacity[i] <= ws->cluster_capacity[c],
                "cluster capacity for ", c, " CTAs must be in [0, this GPU's ", ws->cluster_capacity[c], "]");
    limits.cluster_capacity[c] = static_cast<int>(cluster_capacity[i]);
    if (cluster_capacity[i] > 0) limits.cluster_mask |= 1 << c;
  }
  ws->limits = limits;
}

// [sm_budget, then the capacity per cluster size] as installed.
std::vector<int64_t> ws_launch_limits(int64_t handle) {
  const LaunchLimits& l = as_workspace(handle)->limits;
  std::vector<int64_t> out{l.sm_budget};
  for (int c : kClusterSizes) out.push_back(l.cluster_capacity[c]);
  return out;
}

// The fused one-shot kernel's CTAs per row for a call shape (the rule in ar_kernels.cu), for tests and the
// benchmark: `ctas` is the call's CTA cap, cluster_capacity the agreed capacity per cluster size (ws_launch_limits;
// empty: none launched as clusters, no bound).
int64_t fused_cluster_for(int64_t rows, int64_t hidden, int64_t ctas, std::vector<int64_t> cluster_capacity) {
  TORCH_CHECK(cluster_capacity.empty() || cluster_capacity.size() == kNumClusterSizes,
              "cluster_capacity lists one capacity per cluster size");
  int capacity[kMaxCluster + 1] = {};
  for (size_t i = 0; i < cluster_capacity.size(); ++i) capacity[kClusterSizes[i]] = static_cast<int>(cluster_capacity[i]);
  return fused_cluster_size(static_cast<int>(rows), static_cast<int>(hidden / kElemsPerPack), static_cast<int>(ctas),
                            capacity);
}

// The kernels' limits and the codes of their enums, by name, as one JSON object of integers: the Python policy
// (sgl_kernel_sm120/policy.py) reads them from the library it loads instead of keeping copies that could drift.
std::string kernel_limits() {
  const std::pair<const char*, long long> named[] = {
      {"plain_max_threads", kPlainMaxThreads},
      {"max_packs_per_thread", kMaxPacksPerThread},
      {"max_fused_hidden", kMaxFusedHidden},
      {"max_world", kMaxWorld},
      {"max_ctas", kMaxCounters},
      {"pack_bytes", kPackBytes},
      {"elems_per_pack", kElemsPerPack},
      {"owner_block_packs", kOwnerBlockPacks},
      {"schedule_oneshot", static_cast<int>(Schedule::kOneShot)},
      {"schedule_twoshot", static_cast<int>(Schedule::kTwoShot)},
      {"schedule_island", static_cast<int>(Schedule::kIsland)},
      {"transport_push", kTransportPush},
      {"transport_staged", kTransportStaged},
      {"transport_pull", kTransportPull},
      {"memory_device", static_cast<int>(Memory::kDevice)},
      {"memory_host", static_cast<int>(Memory::kHost)},
  };
  std::string json = "{";
  for (const auto& [name, value] : named) {
    if (json.size() > 1) json += ", ";
    json += std::string("\"") + name + "\": " + std::to_string(value);
  }
  return json + "}";
}

at::Tensor ws_ipc_handle(int64_t handle) {
  cudaIpcMemHandle_t h;
  check_ok(workspace_ipc_handle(as_workspace(handle), &h));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(h))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), &h, sizeof(h));
  return out;
}

void ws_open_peers(int64_t handle, const at::Tensor& handles) {
  Workspace* ws = as_workspace(handle);
  TORCH_CHECK(handles.device().is_cpu() && handles.scalar_type() == at::kByte && handles.dim() == 2 &&
                  handles.size(0) == ws->view.world &&
                  handles.size(1) == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
              "handles must be a CPU uint8 tensor [world, 64]");
  at::Tensor c = handles.contiguous();
  std::vector<cudaIpcMemHandle_t> hs(ws->view.world);
  std::memcpy(hs.data(), c.data_ptr(), hs.size() * sizeof(cudaIpcMemHandle_t));
  check_ok(workspace_open_peers(ws, hs.data()));
}

// The data-path probe (probe.cu): per peer, [what arrived from it, the slab offset of its lowest failed place, what
// this rank's loads from it returned, that offset], a ProbeOutcome (0: all fine) and -1 for no failed place.
std::vector<int64_t> ws_probe(int64_t handle, double timeout_s, int64_t drop_peer, int64_t drop_mode) {
  Workspace* ws = as_workspace(handle);
  TORCH_CHECK(timeout_s > 0 && timeout_s < 3600, "sgl_kernel_sm120: probe timeout must be in (0, 3600) s");
  ProbeOutcomes got{};
  check_ok(workspace_probe(ws, static_cast<long long>(timeout_s * 1e9), static_cast<int>(drop_peer),
                           static_cast<int>(drop_mode), &got));
  std::vector<int64_t> out;
  for (int p = 0; p < ws->view.world; ++p)
    for (int kind = 0; kind < kProbeKinds; ++kind) {
      out.push_back(got.outcome[p][kind]);
      out.push_back(static_cast<int64_t>(got.failed_at[p][kind]));  // all ones: -1
    }
  return out;
}

std::string ws_probe_place_name(int64_t handle, int64_t slab_offset) {
  return probe_place_name(as_workspace(handle)->view, slab_offset);
}

// The cluster check's negative control (sgl_kernel_sm120/cluster_check.py): a kernel that traps, as an illegal
// instruction in a cluster kernel would, killing the CUDA context of the process that runs it.
void debug_trap(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<int>(device));
  check_ok(launch_debug_trap(c10::cuda::getCurrentCUDAStream().stream()));
}

void ws_close_peers(int64_t handle) { check_ok(workspace_close_peers(as_workspace(handle))); }

void ws_destroy(int64_t handle) { check_ok(workspace_destroy(reinterpret_cast<Workspace*>(handle))); }

// Addresses of the host-mapped ErrorRecord and SlowRecord, read from Python through ctypes without any CUDA
// call (the context may be dead after a timeout trap).
int64_t ws_error_record_address(int64_t handle) {
  return reinterpret_cast<int64_t>(&as_workspace(handle)->host_records->error);
}
int64_t ws_slow_record_address(int64_t handle) {
  return reinterpret_cast<int64_t>(&as_workspace(handle)->host_records->slow);
}

int64_t ws_dirty_halves(int64_t handle) {
  long long n = 0;
  check_ok(workspace_dirty_halves(as_workspace(handle), &n));
  return n;
}

// Calls completed, read without synchronizing the device (graph replays included): for live counters.
int64_t ws_calls_completed(int64_t handle) {
  return static_cast<int64_t>(workspace_calls_completed(as_workspace(handle)));
}

// Raises once this process's CUDA context has ended (a trap): the watchdog's question.
void ws_check_context(int64_t handle) { check_ok(workspace_context_error(as_workspace(handle))); }

int64_t ws_sm_count(int64_t handle) { return as_workspace(handle)->view.num_counters; }

ElemType elem_type_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "sgl_kernel_sm120: only bfloat16 and float16 are supported, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? ElemType::kBFloat16 : ElemType::kFloat16;
}

void check_io(const Workspace* ws, const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.get_device() == ws->device, name, " must be on cuda:", ws->device);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the input's dtype");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

Schedule schedule_of(const Workspace* ws, int64_t code) {
  TORCH_CHECK(code >= 0 && code <= static_cast<int64_t>(Schedule::kIsland), "unknown schedule ", code);
  const Schedule schedule = static_cast<Schedule>(code);
  TORCH_CHECK(schedule != Schedule::kIsland || ws->view.islands.num_islands >= 2,
              "the island schedule needs a workspace created with islands");
  return schedule;
}

// A workspace a call may run on: open, and no wait of it has timed out (I7, I12: a poisoned workspace would do
// nothing and leave the outputs as they were; after a trap the CUDA context is gone).
Workspace* usable_workspace(int64_t handle) {
  Workspace* ws = as_workspace(handle);
  const volatile ErrorRecord& rec = ws->host_records->error;
  TORCH_CHECK(rec.flag == 0, "sgl_kernel_sm120: this workspace timed out (rank ", rec.rank, " waited in call #",
              rec.seq, " for rank ", rec.peer, ") and runs nothing more");
  return ws;
}

// Every call fits the workspace: the bound it was built for, and for one-shot the slots' own bound (smaller in host
// memory at 4 and 8 ranks, see scratch_sizes).
void check_fits(const Workspace* ws, int64_t numel, Schedule schedule) {
  TORCH_CHECK(numel <= ws->max_numel, "tensor larger than the workspace (", numel, " > ", ws->max_numel, " elements)");
  TORCH_CHECK(schedule != Schedule::kOneShot || numel * 2 <= ws->view.oneshot_slot_bytes, "one-shot takes at most ",
              ws->view.oneshot_slot_bytes / 2, " elements in this workspace, got ", numel);
}

// The call's launch shape from the group-agreed limits (identical on every rank, so is the grid).
LaunchShape launch_shape(const Workspace* ws, int threads, int64_t ctas, bool pdl, int cluster, int64_t transport,
                         int64_t window) {
  TORCH_CHECK(transport == kTransportPush || transport == kTransportStaged || transport == kTransportPull,
              "unknown transport ", transport, " (0 push, 1 staged, 2 pull)");
  TORCH_CHECK(window == 0 || (window >= 1 && window <= ws->view.world - 1),
              "window must be 0 (the kernels' default) or 1 .. world - 1 = ", ws->view.world - 1, ", got ", window);
  TORCH_CHECK(ctas >= 1, "ctas must be at least 1 (a resolved route's CTA cap), got ", ctas);
  LaunchShape shape{threads, static_cast<int>(std::min<int64_t>(ctas, ws->limits.sm_budget)), pdl, cluster};
  shape.transport = static_cast<int>(transport);
  shape.cluster_mask = ws->limits.cluster_mask;
  for (int c : kClusterSizes) shape.cluster_capacity[c] = ws->limits.cluster_capacity[c];
  shape.window = static_cast<int>(window);
  return shape;
}

void all_reduce(int64_t handle, const at::Tensor& inp, at::Tensor& out, int64_t schedule, int64_t threads,
                int64_t ctas, bool pdl, int64_t transport, int64_t window) {
  Workspace* ws = usable_workspace(handle);
  const ElemType type = elem_type_of(inp);
  check_io(ws, inp, inp, "inp");
  check_io(ws, out, inp, "out");
  TORCH_CHECK(out.numel() == inp.numel(), "out must have inp's size");
  TORCH_CHECK(inp.numel() % kElemsPerPack == 0 && inp.numel() > 0, "numel must be a positive multiple of ",
              kElemsPerPack);
  TORCH_CHECK(threads >= 32 && threads <= kPlainMaxThreads && threads % 32 == 0,
              "threads must be whole warps, at most ", kPlainMaxThreads);
  const Schedule s = schedule_of(ws, schedule);
  check_fits(ws, inp.numel(), s);
  const c10::cuda::CUDAGuard guard(ws->device);
  const LaunchShape shape = launch_shape(ws, static_cast<int>(threads), ctas, pdl, 0, transport, window);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_ok(workspace_enter_stream(ws, stream));  // I6
  const cudaError_t err = launch_all_reduce(ws->view, s, type, inp.data_ptr(), out.data_ptr(), inp.numel(), shape,
                                            stream);
  TORCH_CHECK(err == cudaSuccess, "sgl_kernel_sm120 all_reduce launch: ", cudaGetErrorString(err));
}

void all_reduce_add_rmsnorm(int64_t handle, const at::Tensor& inp, const at::Tensor& residual,
                            const at::Tensor& weight, double eps, at::Tensor& norm_out, at::Tensor& residual_out,
                            int64_t schedule, int64_t ctas, bool pdl, int64_t cluster, int64_t transport,
                            int64_t window) {
  Workspace* ws = usable_workspace(handle);
  const ElemType type = elem_type_of(inp);
  TORCH_CHECK(inp.dim() == 2, "inp must be [tokens, hidden]");
  const int64_t rows = inp.size(0);
  const int64_t hidden = inp.size(1);
  TORCH_CHECK(rows > 0 && hidden > 0 && hidden % kElemsPerPack == 0, "hidden must be a positive multiple of ",
              kElemsPerPack);
  TORCH_CHECK(hidden <= kMaxFusedHidden, "hidden must be at most ", kMaxFusedHidden, " for the fused op");
  const Schedule s = schedule_of(ws, schedule);
  check_fits(ws, inp.numel(), s);
  check_io(ws, inp, inp, "inp");
  check_io(ws, residual, inp, "residual");
  check_io(ws, weight, inp, "weight");
  check_io(ws, norm_out, inp, "norm_out");
  check_io(ws, residual_out, inp, "residual_out");
  TORCH_CHECK(residual.sizes() == inp.sizes() && norm_out.sizes() == inp.sizes() &&
                  residual_out.sizes() == inp.sizes(),
              "residual, norm_out and residual_out must have inp's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight must be [hidden]");
  const c10::cuda::CUDAGuard guard(ws->device);
  bool known_cluster = cluster == 0 || cluster == 1;
  for (int c : kClusterSizes) known_cluster = known_cluster || cluster == c;
  TORCH_CHECK(known_cluster, "cluster must be 0 (the kernels' rule), 1 or one of ", listed(kClusterSizes));
  // threads 0: the fused kernels size their own CTAs
  const LaunchShape shape = launch_shape(ws, 0, ctas, pdl, static_cast<int>(cluster), transport, window);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_ok(workspace_enter_stream(ws, stream));  // I6
  const cudaError_t err = launch_all_reduce_add_rmsnorm(
      ws->view, s, type, inp.data_ptr(), residual.data_ptr(), weight.data_ptr(),
      norm_out.data_ptr(), residual_out.data_ptr(), static_cast<int>(rows), static_cast<int>(hidden),
      static_cast<float>(eps), shape, stream);
  TORCH_CHECK(err == cudaSuccess, "sgl_kernel_sm120 all_reduce_add_rmsnorm launch: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace sgl_sm120

TORCH_LIBRARY(sgl_kernel_sm120, m) {
  using namespace sgl_sm120;
  m.def(
      "ws_create(int device, int rank, int world, int max_numel, int oneshot_max_numel, float timeout_s, float warn_s, "
      "bool trap_on_timeout, int[] flat_island_ranks, int[] flat_twin_ranks, int flat_my_island, int flat_my_index, "
      "int[] isl_island_ranks, int[] isl_twin_ranks, int isl_my_island, int isl_my_index, int memory, "
      "str shared_dir, str shared_name, bool shared_create) -> int",
      &ws_create);
  m.def("ws_register_shared(int ws) -> ()", &ws_register_shared);
  m.def("ws_link_local(int[] handles) -> ()", &ws_link_local);
  m.def("host_shared_bytes_for(int world, int max_numel, int oneshot_max_numel) -> int", &host_shared_bytes_for);
  m.def("ws_host_numa(int ws) -> int[]", &ws_host_numa);
  m.def("cluster_capacity_for(int device, int world) -> int[]", &cluster_capacity_for);
  m.def("ws_cluster_capacity(int ws) -> int[]", &ws_cluster_capacity);
  m.def("ws_set_launch_limits(int ws, int sm_budget, int[] cluster_capacity) -> ()", &ws_set_launch_limits);
  m.def("ws_launch_limits(int ws) -> int[]", &ws_launch_limits);
  m.def("ws_probe_place_name(int ws, int slab_offset) -> str", &ws_probe_place_name);
  m.def("debug_trap(int device) -> ()", &debug_trap);
  m.def("ws_create_loopback(int device, int world, int max_numel) -> int", &ws_create_loopback);
  m.def("ws_loopback_refill(int ws) -> ()", &ws_loopback_refill);
  m.def("ws_unlink_shared(int ws) -> ()", &ws_unlink_shared);
  m.def("fused_cluster_for(int rows, int hidden, int ctas, int[] cluster_capacity=[]) -> int",
        &fused_cluster_for);
  m.def("ws_ipc_handle(int ws) -> Tensor", &ws_ipc_handle);
  m.def("ws_open_peers(int ws, Tensor handles) -> ()", &ws_open_peers);
  m.def("ws_close_peers(int ws) -> ()", &ws_close_peers);
  m.def("ws_probe(int ws, float timeout_s, int drop_peer, int drop_mode) -> int[]", &ws_probe);
  m.def("ws_destroy(int ws) -> ()", &ws_destroy);
  m.def("ws_error_record_address(int ws) -> int", &ws_error_record_address);
  m.def("ws_slow_record_address(int ws) -> int", &ws_slow_record_address);
  m.def("ws_dirty_halves(int ws) -> int", &ws_dirty_halves);
  m.def("ws_calls_completed(int ws) -> int", &ws_calls_completed);
  m.def("ws_check_context(int ws) -> ()", &ws_check_context);
  m.def("kernel_limits() -> str", &kernel_limits);
  m.def("ws_sm_count(int ws) -> int", &ws_sm_count);
  m.def(
      "all_reduce(int ws, Tensor inp, Tensor(a!) out, int schedule, int threads, int ctas, bool pdl, "
      "int transport, int window=0) -> ()",
      &all_reduce);
  m.def(
      "all_reduce_add_rmsnorm(int ws, Tensor inp, Tensor residual, Tensor weight, float eps, "
      "Tensor(a!) norm_out, Tensor(b!) residual_out, int schedule, int ctas, bool pdl, int cluster, "
      "int transport, int window=0) -> ()",
      &all_reduce_add_rmsnorm);
}

// The ops register themselves when the library loads; importing it as a Python module is the way to load it.
// Its name carries the torch it was built for (sgl_kernel_sm120/_abi.py), and torch's extension build passes
// that name as TORCH_EXTENSION_NAME, so the init function Python looks for is PyInit_<that name>.
#ifndef TORCH_EXTENSION_NAME
#error "TORCH_EXTENSION_NAME must name the module (torch.utils.cpp_extension defines it)"
#endif
#define SGL_SM120_CAT2(a, b) a##b
#define SGL_SM120_CAT(a, b) SGL_SM120_CAT2(a, b)
#define SGL_SM120_STR2(x) #x
#define SGL_SM120_STR(x) SGL_SM120_STR2(x)
static PyModuleDef sgl_kernel_sm120_module = {PyModuleDef_HEAD_INIT, SGL_SM120_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                                              nullptr};
PyMODINIT_FUNC SGL_SM120_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&sgl_kernel_sm120_module); }
