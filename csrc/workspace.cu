// The workspace: allocation in device memory (CUDA IPC between ranks) or in shared pinned host memory (no
// P2P), handle export/import, the one-time fill with "empty" (I1), a loopback workspace for benchmarks, and debug
// views of the scratch for tests.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
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

__global__ void trap_kernel() { __trap(); }

__global__ void fill_ready_kernel(uint32_t* p, long long words) {
  // 0x3F80: bf16 1.0 in both halves; never kEmptyHalf (I3 reads it as arrived)
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    p[i] = 0x3F803F80u;
}

// Loopback: every flag of the slab published for the next call, whose counter is the Ctrl's seq + 1 (a wait reads
// the word of its call's parity and wants exactly that, transports/pull.cuh P3). The previous call advanced seq
// before this kernel starts (same stream, I6).
__global__ void fill_flags_kernel(const Ctrl* ctrl, unsigned long long* flags, long long words) {
  const unsigned long long next = *reinterpret_cast<const volatile unsigned long long*>(&ctrl->seq[0]) + 1ull;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    flags[i] = next;
}

struct ScratchSizes {
  long long oneshot_slot;
  long long chunk_slot;
  long long region;       // one parity region (push)
  long long pull_input;   // pull: the input copy (the largest payload)
  long long pull_region;  // pull: one parity's area, [input copy][partial: 2 chunks][result: chunk]
  long long slab;         // Ctrl + flags + both push regions + both pull areas, a whole number of pages (kHost:
                          // each rank binds its own)
};

ScratchSizes scratch_sizes(int world, long long max_numel, long long oneshot_max_numel, const Topology& flat,
                           const Topology& islands) {
  const long long max_packs = max_numel / kElemsPerPack;
  ScratchSizes z{};
  // One-shot slots hold the largest one-shot call only: with the workspace in host memory, one-shot serves small
  // calls only at 4 and 8 ranks (HOST_ONESHOT_MAX_BYTES), and sizing its W slots by the whole bound would make
  // the shared buffer W times larger than needed.
  z.oneshot_slot = oneshot_max_numel / kElemsPerPack * kPackBytes;
  // Hierarchical slots are sized for the smallest island of the two topologies (the largest chunk). A chunk is
  // a whole number of owner blocks (kOwnerBlockPacks): an owner's share is at most that many blocks.
  int min_island = flat.island_size;
  int max_groups = flat.num_islands;
  if (islands.num_islands > 0) {
    min_island = std::min(min_island, islands.island_size);
    max_groups = std::max(max_groups, islands.num_islands);
  }
  const long long per_round = static_cast<long long>(kOwnerBlockPacks) * min_island;
  const long long chunk_packs = (max_packs + per_round - 1) / per_round * kOwnerBlockPacks;
  z.chunk_slot = chunk_packs * kPackBytes;
  const long long oneshot_region = static_cast<long long>(world) * z.oneshot_slot;
  const long long hier_region = (2ll * world + 2ll * max_groups) * z.chunk_slot;  // RS + AG + XS, worst case
  z.region = (std::max(oneshot_region, hier_region) + 255) / 256 * 256;
  z.pull_input = (max_packs * kPackBytes + 255) / 256 * 256;
  z.pull_region = z.pull_input + 3 * z.chunk_slot;
  z.slab = (kRegionsOffset + 2 * z.region + 2 * z.pull_region + 4095) / 4096 * 4096;
  return z;
}

ScratchSizes scratch_sizes(const WorkspaceConfig& cfg) {
  return scratch_sizes(cfg.world, cfg.max_numel, cfg.oneshot_max_numel, cfg.flat, cfg.islands);
}

std::string errno_failure(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string mebibytes(long long bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

// The NUMA node of the device's PCI function, from sysfs; -1 when unknown. Plain read(2) and strtol, no iostreams:
// `std::ifstream >> int` here was seen to die of SIGSEGV inside the library's locale code (std::codecvt).
int numa_node_of(int device) {
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) return -1;
  std::string id(bus);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string path = "/sys/bus/pci/devices/" + id + "/numa_node";
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return -1;
  char text[16] = {};
  const ssize_t got = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (got <= 0) return -1;
  char* end = nullptr;
  const long node = std::strtol(text, &end, 10);
  if (end == text || node < -1 || node > 4095) return -1;
  return static_cast<int>(node);
}

// Prefer `node` for the pages of [addr, addr + bytes) of a shared mapping: tmpfs keeps the policy with the file's
// range, so the pages allocated below land there. Best effort: false where the kernel refuses (no NUMA, a
// container without the capability); the workspace works either way, only a poll's distance differs.
bool prefer_numa_node(void* addr, long long bytes, int node) {
  if (node < 0 || node >= 1024) return false;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
  constexpr int kMpolPreferred = 1;
  return syscall(SYS_mbind, addr, static_cast<unsigned long>(bytes), kMpolPreferred, mask,
                 static_cast<unsigned long>(8 * sizeof(mask)), 0u) == 0;
}

// kHost: map the group's shared buffer (the creating rank creates the file first, sparse), then allocate and fill
// this rank's own slab: the slab this rank polls, so its pages go to this GPU's NUMA node rather than all to the
// creator's. The host checked the folder's free space first; posix_fallocate still makes a tmpfs that filled up
// since an error now, naming the folder and the sizes, where a bare ftruncate would succeed and the first store
// to a missing page would raise SIGBUS. The buffer is pinned later
// (workspace_register_shared), once every rank's slab exists: pinning earlier would allocate the other slabs'
// pages here.
std::string map_shared_scratch(const WorkspaceConfig& cfg, Workspace* ws, bool* out_of_space) {
  if (cfg.shared_name.empty() || cfg.shared_name.find('/') != std::string::npos)
    return "host memory: the shared file's name must be non-empty and hold no '/' (got '" + cfg.shared_name + "')";
  const std::string dir = cfg.shared_dir.empty() ? std::string("/dev/shm") : cfg.shared_dir;
  const std::string path = dir + "/" + cfg.shared_name;
  ws->shared_bytes = static_cast<long long>(cfg.world) * ws->slab_bytes;
  ws->shared_name = path;
  const std::string need = mebibytes(ws->shared_bytes) + " (" + std::to_string(cfg.world) + " slabs of " +
                           mebibytes(ws->slab_bytes) + ")";
  const int fd = open(path.c_str(), cfg.shared_create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return errno_failure("host memory: open(" + path + ")");
  if (cfg.shared_create) {
    ws->shared_owner = true;
    ws->shared_linked = true;
    if (ftruncate(fd, ws->shared_bytes) != 0) {
      const std::string err = errno_failure("host memory: ftruncate of " + path + " to " + need);
      close(fd);
      return err;
    }
  } else {
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size != ws->shared_bytes) {
      close(fd);
      return "host memory: " + path + " has " + std::to_string(static_cast<long long>(st.st_size)) +
             " B, this rank expects " + std::to_string(ws->shared_bytes) + " B (arguments differ across ranks?)";
    }
  }
  void* p = mmap(nullptr, ws->shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const std::string err = errno_failure("host memory: mmap of " + need);
    close(fd);
    return err;
  }
  ws->shared = static_cast<char*>(p);
  const long long own = static_cast<long long>(cfg.rank) * ws->slab_bytes;
  ws->numa_node = numa_node_of(cfg.device);
  ws->numa_bound = prefer_numa_node(ws->shared + own, ws->slab_bytes, ws->numa_node);
  const int rc = posix_fallocate(fd, own, ws->slab_bytes);
  close(fd);
  if (rc != 0) {
    *out_of_space = rc == ENOSPC;
    struct statvfs fs {};
    const long long free_bytes =
        statvfs(dir.c_str(), &fs) == 0 ? static_cast<long long>(fs.f_bavail) * static_cast<long long>(fs.f_frsize) : -1;
    return "host memory: allocating this rank's slab in " + dir + " failed (" + std::strerror(rc) + "): " + dir +
           " has " + (free_bytes >= 0 ? mebibytes(free_bytes) : std::string("an unknown amount")) +
           " free, the workspace needs " + need;  // construction.py adds the remedy (SHM_ADVICE)
  }
  // I1 for this rank's slab, before any rank can use the workspace (the host agrees every rank's outcome first);
  // its flags start at 0 (transports/pull.cuh P3).
  uint32_t* words = reinterpret_cast<uint32_t*>(ws->shared + own);
  std::fill(words, words + ws->slab_bytes / 4, kEmptyWord);
  std::memset(ws->shared + own + kCtrlBytes, 0, kFlagBytes);
  return "";
}

// The Ctrl block and the host-mapped records, common to every kind of workspace.
std::string init_control(Workspace* ws, char* ctrl) {
  cudaError_t err = cudaMemset(ctrl, 0, kCtrlBytes);
  if (err == cudaSuccess) err = cudaHostAlloc(&ws->host_records, sizeof(HostRecords), cudaHostAllocMapped);
  if (err == cudaSuccess) {
    std::memset(ws->host_records, 0, sizeof(HostRecords));
    HostRecords* device_view = nullptr;
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), ws->host_records, 0);
    if (err == cudaSuccess) {
      ws->view.error = &device_view->error;
      ws->view.slow = &device_view->slow;
      ws->view.calls_completed = &device_view->calls_completed;
    }
  }
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ws->order_event, cudaEventDisableTiming);  // I6
  if (err != cudaSuccess) return cuda_failure("initialising the workspace's control block", err);
  ws->view.ctrl = reinterpret_cast<Ctrl*>(ctrl);
  return "";
}

}  // namespace

std::string workspace_create(const WorkspaceConfig& cfg, Workspace** out, bool* out_of_space) {
  *out = nullptr;
  *out_of_space = false;
  if (!is_world_size(cfg.world)) return "world size must be one of " + listed(kWorldSizes);
  if (cfg.rank < 0 || cfg.rank >= cfg.world) return "rank out of range";
  if (cfg.max_numel <= 0 || cfg.max_numel % kElemsPerPack != 0) return "max_numel must be a positive multiple of 8";
  if (cfg.oneshot_max_numel <= 0 || cfg.oneshot_max_numel % kElemsPerPack != 0 || cfg.oneshot_max_numel > cfg.max_numel)
    return "oneshot_max_numel must be a positive multiple of 8, at most max_numel";
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(cfg.device));

  // Everything that can fail without allocating comes first, so a failure here leaks nothing.
  int sm_count = 0;
  SGL_RETURN_IF_CUDA("cudaDeviceGetAttribute(SM count)",
                     cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, cfg.device));
  // A device that cannot say how many clusters it holds gets none: the grouped kernel computes the same bits.
  int capacity[kMaxCluster + 1] = {};
  for (int c : kClusterSizes) {
    if (query_cluster_capacity(cfg.device, cfg.world, c, &capacity[c]) != cudaSuccess) {
      capacity[c] = 0;
      (void)cudaGetLastError();  // not sticky: clear it so that the next call does not report it
    }
  }
  auto* ws = new Workspace();
  ws->device = cfg.device;
  ws->memory = cfg.memory;
  ws->sm_count = sm_count;
  for (int c : kClusterSizes) ws->cluster_capacity[c] = capacity[c];
  const ScratchSizes z = scratch_sizes(cfg);
  ws->slab_bytes = z.slab;  // kHost: each rank's slab keeps the (unused) Ctrl head too, so region_of() is the same

  std::string failure;
  if (cfg.memory == Memory::kHost) {
    cudaError_t err = cudaMalloc(&ws->local, kCtrlBytes);
    if (err != cudaSuccess) failure = cuda_failure("cudaMalloc of the control block", err);
    if (failure.empty()) failure = map_shared_scratch(cfg, ws, out_of_space);
  } else {
    cudaError_t err = cudaMalloc(&ws->local, ws->slab_bytes);
    if (err != cudaSuccess) {
      failure = cuda_failure("cudaMalloc of the IPC slab", err);
    } else {
      fill_empty_kernel<<<256, 256>>>(reinterpret_cast<uint32_t*>(ws->local + kRegionsOffset),
                                      (ws->slab_bytes - kRegionsOffset) / 4);
      err = cudaGetLastError();
      if (err == cudaSuccess) err = cudaMemset(ws->local + kCtrlBytes, 0, kFlagBytes);  // flags start at 0 (P3)
      if (err != cudaSuccess) failure = cuda_failure("filling the IPC slab", err);
      ws->view.bases[cfg.rank] = ws->local;
    }
  }
  if (failure.empty()) failure = init_control(ws, ws->local);
  if (failure.empty()) {
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) failure = cuda_failure("initialising the workspace", err);
  }
  if (!failure.empty()) {
    workspace_destroy(ws);
    return failure;
  }

  WorkspaceView& v = ws->view;
  v.rank = cfg.rank;
  v.world = cfg.world;
  v.region_bytes = z.region;
  v.oneshot_slot_bytes = z.oneshot_slot;
  v.chunk_slot_bytes = z.chunk_slot;
  v.pull_offset = kRegionsOffset + 2 * z.region;
  v.pull_region_bytes = z.pull_region;
  v.pull_input_bytes = z.pull_input;
  v.timeout_ns = cfg.timeout_ns;
  v.warn_ns = cfg.warn_ns;
  v.num_counters = std::min(ws->sm_count, kMaxCounters);
  v.host_memory = cfg.memory == Memory::kHost ? 1 : 0;
  v.trap_on_timeout = cfg.trap_on_timeout ? 1 : 0;
  v.flat = cfg.flat;
  v.islands = cfg.islands;
  ws->max_numel = cfg.max_numel;
  ws->limits.sm_budget = v.num_counters;  // until the group agrees (Python: ws_set_launch_limits)
  *out = ws;
  return "";
}

std::string workspace_register_shared(Workspace* ws) {
  if (ws->memory != Memory::kHost || ws->shared == nullptr) return "only a host-memory workspace has a shared buffer";
  if (ws->shared_registered) return "";
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  SGL_RETURN_IF_CUDA("cudaHostRegister of the shared scratch",
                     cudaHostRegister(ws->shared, ws->shared_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  ws->shared_registered = true;
  char* device_view = nullptr;
  SGL_RETURN_IF_CUDA("cudaHostGetDevicePointer of the shared scratch",
                     cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), ws->shared, 0));
  for (int r = 0; r < ws->view.world; ++r) ws->view.bases[r] = device_view + static_cast<long long>(r) * ws->slab_bytes;
  return "";
}

long long host_shared_bytes(int world, long long max_numel, long long oneshot_max_numel) {
  Topology flat{};
  flat.island_size = world;
  flat.num_islands = 1;
  Topology none{};
  return static_cast<long long>(world) * scratch_sizes(world, max_numel, oneshot_max_numel, flat, none).slab;
}

std::string workspace_create_loopback(int device, int world, long long max_numel, Workspace** out) {
  WorkspaceConfig cfg{};
  cfg.device = device;
  cfg.rank = 0;
  cfg.world = world;
  cfg.max_numel = max_numel;
  cfg.oneshot_max_numel = max_numel;
  cfg.timeout_ns = 10ll * 1000 * 1000 * 1000;
  cfg.warn_ns = cfg.timeout_ns;
  cfg.flat.island_size = world;
  cfg.flat.num_islands = 1;
  for (int r = 0; r < world; ++r) cfg.flat.island_ranks[r] = r;
  Workspace* ws = nullptr;
  bool out_of_space = false;
  std::string err = workspace_create(cfg, &ws, &out_of_space);
  if (!err.empty()) return err;
  ws->loopback = true;
  // A benchmark of the kernels' own work: it trusts the device's cluster capacity (no cluster check, no group).
  for (int c : kClusterSizes) {
    ws->limits.cluster_capacity[c] = ws->cluster_capacity[c];
    if (ws->cluster_capacity[c] > 0) ws->limits.cluster_mask |= 1 << c;
  }
  for (int r = 1; r < world; ++r) {
    const cudaError_t e = cudaMalloc(&ws->loopback_slabs[r], ws->slab_bytes);
    if (e != cudaSuccess) {
      workspace_destroy(ws);
      return cuda_failure("cudaMalloc of a loopback peer slab", e);
    }
    ws->view.bases[r] = ws->loopback_slabs[r];
  }
  *out = ws;
  return "";
}

std::string workspace_loopback_refill(Workspace* ws, cudaStream_t stream) {
  if (!ws->loopback) return "refill is for loopback workspaces only";
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  // Everything after the flags, in our slab and the stand-in peers': every pack reads as arrived (push), every
  // peer's pull copy holds 1.0 (pull); and our own flags, the only ones read, as published for the next call.
  for (int r = 0; r < ws->view.world; ++r) {
    char* slab = r == 0 ? ws->local : ws->loopback_slabs[r];
    fill_ready_kernel<<<128, 256, 0, stream>>>(reinterpret_cast<uint32_t*>(slab + kRegionsOffset),
                                               (ws->slab_bytes - kRegionsOffset) / 4);
  }
  auto* flags = reinterpret_cast<unsigned long long*>(ws->local + kCtrlBytes);
  fill_flags_kernel<<<32, 256, 0, stream>>>(ws->view.ctrl, flags, kFlagBytes / 8);
  SGL_RETURN_IF_CUDA("loopback refill launch", cudaGetLastError());
  return "";
}

std::string workspace_link_local(Workspace** group, int world) {
  for (int r = 0; r < world; ++r) {
    Workspace* ws = group[r];
    if (ws->memory != Memory::kDevice || ws->view.world != world || ws->view.rank != r)
      return "a local group links device-memory workspaces of ranks 0..W-1 of one world, in rank order";
    if (ws->device != group[0]->device || ws->slab_bytes != group[0]->slab_bytes)
      return "a local group's workspaces must share a device and a size";
  }
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world; ++q) group[r]->view.bases[q] = group[q]->local;
  return "";
}

std::string launch_debug_trap(cudaStream_t stream) {
  trap_kernel<<<1, 1, 0, stream>>>();
  SGL_RETURN_IF_CUDA("debug trap launch", cudaGetLastError());
  return "";
}

std::string workspace_unlink_shared(Workspace* ws) {
  if (ws->memory != Memory::kHost || !ws->shared_owner || !ws->shared_linked) return "";
  ws->shared_linked = false;
  if (unlink(ws->shared_name.c_str()) != 0) return errno_failure("unlink(" + ws->shared_name + ")");
  return "";
}

std::string workspace_ipc_handle(const Workspace* ws, cudaIpcMemHandle_t* handle) {
  if (ws->memory != Memory::kDevice) return "a host-memory workspace has no IPC handle (its peers map /dev/shm)";
  SGL_RETURN_IF_CUDA("cudaSetDevice", cudaSetDevice(ws->device));
  SGL_RETURN_IF_CUDA("cudaIpcGetMemHandle", cudaIpcGetMemHandle(handle, ws->local));
  return "";
}

std::string workspace_open_peers(Workspace* ws, const cudaIpcMemHandle_t* handles) {
  if (ws->memory != Memory::kDevice) return "a host-memory workspace opens no IPC handles";
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
    if (ws->loopback_slabs[r]) note("cudaFree (loopback)", cudaFree(ws->loopback_slabs[r]));
  }
  // kHost: the pages stay until every rank has unmapped them, so no rank frees memory a peer still uses.
  if (ws->shared_registered) note("cudaHostUnregister", cudaHostUnregister(ws->shared));
  if (ws->shared != nullptr && munmap(ws->shared, ws->shared_bytes) != 0 && first_error.empty())
    first_error = errno_failure("munmap of the shared scratch");
  if (ws->shared_owner && ws->shared_linked) unlink(ws->shared_name.c_str());  // a failed creation
  if (ws->local) note("cudaFree", cudaFree(ws->local));
  if (ws->host_records) note("cudaFreeHost", cudaFreeHost(ws->host_records));
  if (ws->order_event) note("cudaEventDestroy", cudaEventDestroy(ws->order_event));
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
    // The push regions only: the pull areas carry no sentinels and the flags are counters (ar_types.h).
    count_dirty_kernel<<<256, 256>>>(reinterpret_cast<const uint32_t*>(ws->view.bases[ws->view.rank] + kRegionsOffset),
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

unsigned long long workspace_calls_completed(const Workspace* ws) {
  return *reinterpret_cast<const volatile unsigned long long*>(&ws->host_records->calls_completed);
}

// A query of the legacy stream: "not ready" is a busy, living context; a trap's error is sticky and comes back here.
std::string workspace_context_error(const Workspace* ws) {
  cudaError_t err = cudaSetDevice(ws->device);
  if (err == cudaSuccess) err = cudaStreamQuery(nullptr);
  if (err == cudaSuccess || err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return "";
  }
  return cuda_failure("the CUDA context", err);
}

namespace {

// The CUDA failure of an I6 step, the runtime's last error cleared (it is not sticky, and a later torch check of
// its own launch would otherwise report it).
std::string stream_failure(const char* what, cudaError_t err) {
  (void)cudaGetLastError();
  return cuda_failure(what, err);
}

std::string stream_name(cudaStream_t stream) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", static_cast<void*>(stream));
  return stream == nullptr ? std::string("the default stream") : "stream " + std::string(text);
}

// I6: `later` waits for everything issued on `earlier` so far. SGL_SM120_DEBUG_NO_STREAM_ORDER breaks it on purpose.
std::string order_after(Workspace* ws, cudaStream_t earlier, cudaStream_t later) {
#ifdef SGL_SM120_DEBUG_NO_STREAM_ORDER
  (void)ws;
  (void)earlier;
  (void)later;
  return "";
#else
  cudaError_t err = cudaEventRecord(ws->order_event, earlier);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(later, ws->order_event, 0);
  return err == cudaSuccess ? "" : stream_failure("ordering a call after the previous stream's (I6)", err);
#endif
}

}  // namespace

// I6, the slow path: CUDA's answers through the rule (stream_step, ar_launch.h), then its step.
std::string workspace_change_stream(Workspace* ws, cudaStream_t stream) {
  cudaError_t failed = cudaSuccess;
  const StreamStep step = stream_step(ws->streams, stream, [&failed](cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    const cudaError_t err = cudaStreamGetCaptureInfo(s, &status, &id);
    if (err != cudaSuccess || status == cudaStreamCaptureStatusInvalidated) {
      failed = err != cudaSuccess ? err : cudaErrorStreamCaptureInvalidated;
      return kCaptureUnknown;
    }
    return status == cudaStreamCaptureStatusActive ? id : 0ull;
  });
  switch (step.kind) {
    case StreamStep::kUnknown:
      return stream_failure(("asking whether " + stream_name(step.after) + " captures a graph (I6)").c_str(), failed);
    case StreamStep::kRefuse:
      return "one workspace's calls are totally ordered (csrc/ar_protocol.cuh I6), and this eager call from " +
             stream_name(stream) + " cannot be ordered after the previous eager call, on " + stream_name(step.after) +
             ", which is capturing a CUDA graph now: make this call on that stream, or after its capture ends";
    case StreamStep::kOrderAfter: {
      const std::string err = order_after(ws, step.after, stream);
      if (!err.empty()) return err;
      break;
    }
    case StreamStep::kGo:
      break;
  }
  ws->streams = step.next;
  return "";
}

}  // namespace sgl_sm120
