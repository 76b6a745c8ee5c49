// The IPC workspace: allocation, handle export/import, the one-time fill with "empty" (I1), and debug views
// of the scratch for tests.
#include <algorithm>
#include <cstring>
#include <string>

#include "ar_launch.h"

namespace sgl_sm120 {
namespace {

std::string cuda_failure(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

#define SGL_RETURN_IF_CUDA(what, expr)                 \
  do {                                                  \
    const cudaError_t err_ = (expr);                    \
    if (err_ != cudaSuccess) return cuda_failure(what, err_); \
  } while (0)

__global__ void fill_empty_kernel(uint32_t* p, long long words) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    p[i] = kEmptyWord;
}

__global__ void count_dirty_kernel(const uint32_t* p, long long words, unsigned long long* count) {
  unsigned long long local = 0;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint32_t w = p[i];
    local += ((w & 0xFFFFu) != kEmptyHalf) + ((w >> 16) != kEmptyHalf);
  }
  if (local) atomicAdd(count, local);
}

}  // namespace

std::string workspace_create(const WorkspaceConfig& cfg, Workspace** out) {
  *out = nullptr;
  if (cfg.world != 1 && cfg.world != 2 && cfg.world != 4 && cfg.world != 8) return "world size must be 1, 2, 4 or 8";
  if (cfg.rank < 0 || cfg.rank >= cfg.world) return "rank out of range";
  if (cfg.max_numel <= 0 || cfg.max_numel % kElemsPerPack != 0) return "max_numel must be a positive multiple of 8";
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(cfg.device));

  auto* ws = new Workspace();
  ws->device = cfg.device;
  SGL_RETURN_IF_CUDA("cudaDeviceGetAttribute(SM count)",
                     cudaDeviceGetAttribute(&ws->sm_count, cudaDevAttrMultiProcessorCount, cfg.device));

  const long long max_packs = cfg.max_numel / kElemsPerPack;
  const long long oneshot_slot = max_packs * kPackBytes;
  // Hierarchical slots are sized for the smallest island of the two topologies (the largest chunk).
  int min_island = cfg.flat.island_size;
  int max_groups = cfg.flat.num_islands;
  if (cfg.islands.num_islands > 0) {
    min_island = std::min(min_island, cfg.islands.island_size);
    max_groups = std::max(max_groups, cfg.islands.num_islands);
  }
  const long long chunk_packs = (max_packs + min_island - 1) / min_island;
  const long long chunk_slot = chunk_packs * kPackBytes;
  const long long oneshot_region = static_cast<long long>(cfg.world) * oneshot_slot;
  const long long hier_region = (2ll * cfg.world + 2ll * max_groups) * chunk_slot;  // RS + AG + XS, worst case
  long long region = std::max(oneshot_region, hier_region);
  region = (region + 255) / 256 * 256;

  ws->slab_bytes = kCtrlBytes + 2 * region;
  cudaError_t err = cudaMalloc(&ws->local, ws->slab_bytes);
  if (err != cudaSuccess) {
    delete ws;
    return cuda_failure("cudaMalloc of the IPC slab", err);
  }
  err = cudaMemset(ws->local, 0, kCtrlBytes);
  if (err == cudaSuccess) {
    fill_empty_kernel<<<256, 256>>>(reinterpret_cast<uint32_t*>(ws->local + kCtrlBytes), 2 * region / 4);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaHostAlloc(&ws->host_records, sizeof(HostRecords), cudaHostAllocMapped);
  if (err == cudaSuccess) {
    std::memset(ws->host_records, 0, sizeof(HostRecords));
    HostRecords* device_view = nullptr;
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), ws->host_records, 0);
    if (err == cudaSuccess) {
      ws->view.error = &device_view->error;
      ws->view.slow = &device_view->slow;
    }
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    workspace_destroy(ws);
    return cuda_failure("initialising the IPC slab", err);
  }

  WorkspaceView& v = ws->view;
  v.bases[cfg.rank] = ws->local;
  v.rank = cfg.rank;
  v.world = cfg.world;
  v.region_bytes = region;
  v.oneshot_slot_bytes = oneshot_slot;
  v.chunk_slot_bytes = chunk_slot;
  v.ctrl = reinterpret_cast<Ctrl*>(ws->local);
  v.timeout_ns = cfg.timeout_ns;
  v.warn_ns = cfg.warn_ns;
  v.num_counters = std::min(ws->sm_count, kMaxCounters);
  v.flat = cfg.flat;
  v.islands = cfg.islands;
  *out = ws;
  return "";
}

std::string workspace_ipc_handle(const Workspace* ws, cudaIpcMemHandle_t* handle) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  SGL_RETURN_IF_CUDA("cudaIpcGetMemHandle", cudaIpcGetMemHandle(handle, ws->local));
  return "";
}

std::string workspace_open_peers(Workspace* ws, const cudaIpcMemHandle_t* handles) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  for (int r = 0; r < ws->view.world; ++r) {
    if (r == ws->view.rank || ws->peer_opened[r]) continue;
    void* base = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&base, handles[r], cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) return cuda_failure(("cudaIpcOpenMemHandle of rank " + std::to_string(r)).c_str(), err);
    ws->view.bases[r] = static_cast<char*>(base);
    ws->peer_opened[r] = true;
  }
  return "";
}

std::string workspace_close_peers(Workspace* ws) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  std::string first_error;
  for (int r = 0; r < kMaxWorld; ++r) {
    if (!ws->peer_opened[r]) continue;
    const cudaError_t err = cudaIpcCloseMemHandle(ws->view.bases[r]);
    if (err != cudaSuccess && first_error.empty())
      first_error = cuda_failure(("cudaIpcCloseMemHandle of rank " + std::to_string(r)).c_str(), err);
    ws->peer_opened[r] = false;
    ws->view.bases[r] = nullptr;
  }
  return first_error;
}

std::string workspace_destroy(Workspace* ws) {
  if (ws == nullptr) return "";
  std::string first_error;
  auto note = [&](const char* what, cudaError_t err) {
    if (err != cudaSuccess && first_error.empty()) first_error = cuda_failure(what, err);
  };
  note("cudaSetDevice", cudaSetDevice(ws->device));
  for (int r = 0; r < kMaxWorld; ++r) {
    if (ws->peer_opened[r]) note("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(ws->view.bases[r]));
  }
  if (ws->local) note("cudaFree", cudaFree(ws->local));
  if (ws->host_records) note("cudaFreeHost", cudaFreeHost(ws->host_records));
  delete ws;
  return first_error;
}

std::string workspace_dirty_halves(const Workspace* ws, long long* count) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  SGL_RETURN_IF_CUDA("cudaDeviceSynchronize", cudaDeviceSynchronize());
  unsigned long long* d_count = nullptr;
  SGL_RETURN_IF_CUDA("cudaMalloc", cudaMalloc(&d_count, sizeof(unsigned long long)));
  cudaError_t err = cudaMemset(d_count, 0, sizeof(unsigned long long));
  if (err == cudaSuccess) {
    count_dirty_kernel<<<256, 256>>>(reinterpret_cast<const uint32_t*>(ws->local + kCtrlBytes),
                                     2 * ws->view.region_bytes / 4, d_count);
    err = cudaGetLastError();
  }
  unsigned long long host = 0;
  if (err == cudaSuccess) err = cudaMemcpy(&host, d_count, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(d_count);
  if (err != cudaSuccess) return cuda_failure("counting dirty scratch", err);
  *count = static_cast<long long>(host);
  return "";
}

std::string workspace_sequence(const Workspace* ws, unsigned long long* seq) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  SGL_RETURN_IF_CUDA("cudaDeviceSynchronize", cudaDeviceSynchronize());
  SGL_RETURN_IF_CUDA("cudaMemcpy(seq)", cudaMemcpy(seq, &ws->view.ctrl->seq[0], sizeof(*seq), cudaMemcpyDeviceToHost));
  return "";
}

// A live counter for monitoring (the server's /get_server_info): the copy runs on a stream of its own created
// non-blocking, so it waits for no kernel, graph replay or spin-wait on the serving streams, and it is a plain
// 8-byte aligned read of slot 0, which only CTA 0 of a call writes (I5), so it never sees a torn value. It may
// lag the serving stream by the calls still in flight, which is all a counter read from outside can promise.
std::string workspace_calls_completed(const Workspace* ws, unsigned long long* seq) {
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  cudaStream_t side = nullptr;
  SGL_RETURN_IF_CUDA("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaError_t err = cudaMemcpyAsync(seq, &ws->view.ctrl->seq[0], sizeof(*seq), cudaMemcpyDeviceToHost, side);
  if (err == cudaSuccess) err = cudaStreamSynchronize(side);
  const cudaError_t destroyed = cudaStreamDestroy(side);
  if (err == cudaSuccess) err = destroyed;
  if (err != cudaSuccess) return cuda_failure("reading the call counter", err);
  return "";
}

}  // namespace sgl_sm120
