// The data-path probe, run once when a workspace is created, before its first call: one kernel per rank, one round
// for the group.
//
// cudaDeviceCanAccessPeer says what the driver allows, not what the PCIe fabric delivers: with ACS redirection on a
// switch or a translating IOMMU, peer writes can be dropped or land elsewhere while the capability still says yes,
// and the first forward of a server would then die in a timeout (I7). A mapping can also be broken for part of a
// slab only. Mappings (a GPU's page tables, an IOMMU's) are made of pages of at least 4 KiB, so the probe writes one
// pack per sender into every 4 KiB page of every peer's slab that a peer reaches (all of it after the Ctrl head: the
// flags, both parities' push regions and pull areas), through the very path the kernels use (host memory too, where
// the slabs are pages of one shared buffer), and loads every page of the pull areas once more with pull's own loads.
//
// Invariants (relied on by probe_kernel and probe_place_name below; tests/probe_places_check.cu checks P1 and P2 on
// the host for 2, 4 and 8 ranks):
//  P1  Places. In the page at slab offset q (a multiple of kProbePageBytes, from kCtrlBytes to the end of the pull
//      areas), sender s writes pack s of the page in every peer's slab. In a page holding pull-area bytes, the owner
//      stages pack kMaxWorld + j of the page for the reader at position j = (reader - owner - 1) mod W, and that
//      reader loads it. No two senders, readers or kinds share a place, so nothing of one round needs a barrier
//      between its parts, and every page a peer reaches is written by every other rank and every pull page is
//      loaded by every other rank.
//  P2  Tags. Every pack names its kind, its sender (or owner), receiver (or reader) and page, and no half-word of it
//      is the empty fill (I2) and no pack is all zeros (a flag's start): a write that lands in the wrong slab or
//      page is caught as wrong data where it lands and as missing where it should have, and a load served from
//      the wrong page or slab returns wrong data.
//  P3  Writes. A receiver polls each of its places until the sender's pack lands (scratch starts empty, I1; flags at
//      0, transports/pull.cuh P3) or the deadline passes, compares it with the pack it expects, and restores the
//      place (I4), so the first call finds clean scratch.
//  P4  Reads. Pull moves its data by peer loads, which carry no sentinels: a broken read path returns garbage (or,
//      after a PCIe completion timeout, all ones) that pull would sum as data. A reader polls its place in the
//      owner's pull area with pull's load (load_volatile, a system-scope strong load) until its pack shows up or
//      the deadline passes. A place reads as the empty fill until the owner's pack lands: a reader that saw its
//      pack passes and restores the fill (its place alone, P1); one that saw anything else but the fill reports
//      wrong data; one that saw only the fill, the pack missing. Only a reader that saw its pack restores the
//      place: a place never seen may still receive the owner's pack, and the workspace is torn down then anyway.
//  P5  One CTA runs a rank's probe: all of its stores and staging, a CTA barrier, then all of its polls, bounded by
//      one deadline, backing off between misses as host-memory polls do (I13), since every miss may cross PCIe. So
//      a rank's polls wait only for stores its peers issue before they poll: no rank can hold another's probe
//      past the deadline. It never traps.
// The host reads back the worst outcome and the lowest failed offset per peer and kind (Ctrl::probe), names the
// place (probe_place_name), and the group agrees every rank's table in one round
// (sgl_kernel_sm120/data_path_probe.py).
#include <algorithm>

#include "ar_launch.h"
#include "ar_protocol.cuh"

namespace sgl_sm120 {
namespace {

constexpr long long kProbePageBytes = 4096;
constexpr int kReadPackBase = kMaxWorld;  // P1: the first read place of a page, after the write places
static_assert(kProbePageBytes >= 2 * kMaxWorld * kPackBytes, "a probe page holds a place per sender and reader");
static_assert(kCtrlBytes % kProbePageBytes == 0, "the Ctrl head is whole pages, never probed");
constexpr int kProbeThreads = 1024;

// The pages the probe covers (P1): [first, end) for writes, [read_first, end) for loads, as page numbers.
__host__ __device__ __forceinline__ long long areas_end(const WorkspaceView& v) {
  return v.pull_offset + 2 * v.pull_region_bytes;
}
__host__ __device__ __forceinline__ long long probe_page_end(const WorkspaceView& v) {
  return (areas_end(v) + kProbePageBytes - 1) / kProbePageBytes;
}
constexpr long long kProbePageFirst = kCtrlBytes / kProbePageBytes;
__host__ __device__ __forceinline__ long long read_page_first(const WorkspaceView& v) {
  return v.pull_offset / kProbePageBytes;
}

__host__ __device__ __forceinline__ long long write_place(long long page, int sender) {
  return page * kProbePageBytes + static_cast<long long>(sender) * kPackBytes;
}

__host__ __device__ __forceinline__ long long read_place(const WorkspaceView& v, long long page, int owner,
                                                         int reader) {
  const int j = (reader - owner - 1 + v.world) % v.world;
  return page * kProbePageBytes + static_cast<long long>(kReadPackBase + j) * kPackBytes;
}

// P2: every half-word carries a tag byte above it (0x31, 0x52, ... never 0x80) or 15 bits of the page number.
__host__ __device__ __forceinline__ uint4 probe_pattern(bool read, int from, int to, long long page) {
  const uint32_t kind = read ? 0x71000000u : 0x31000000u;
  return make_uint4(kind | (static_cast<uint32_t>(from) << 8) | static_cast<uint32_t>(to),
                    0x52000000u | static_cast<uint32_t>(page & 0x7FFF),
                    0x13000000u | static_cast<uint32_t>((page >> 15) & 0x7FFF), read ? 0x0DDBA115u : 0x2468ACE0u);
}

__device__ __forceinline__ bool same_pack(uint4 a, uint4 b) {
  return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w;
}

__device__ __forceinline__ void report(Ctrl* ctrl, int peer, int kind, int outcome, long long at) {
  atomicMax(&ctrl->probe.outcome[peer][kind], outcome);
  atomicMin(&ctrl->probe.failed_at[peer][kind], static_cast<unsigned long long>(at));
}

// What the debug switch does to this rank's probe with `drop_peer` (sgl_kernel_sm120/data_path_probe.py): skip the
// writes to it, only those into the last page (a mapping broken for part of a slab), or flip a bit of the first
// word of every load from it (a read path that corrupts data: never the pack, never the fill, so wrong data, P4).
constexpr int kDropWrites = 1, kDropReads = 2, kDropLastPageOnly = 4;
constexpr uint32_t kReadDropFlip = 0x00100000u;

__device__ __forceinline__ void probe_backoff(unsigned int misses) {
  __nanosleep(misses >= 3u ? 1024u : 128u << misses);
}

__global__ void __launch_bounds__(kProbeThreads) probe_kernel(WorkspaceView ws, int drop_peer, int drop_mode,
                                                             long long timeout_ns) {
  const int others = ws.world - 1;
  const long long pages = probe_page_end(ws) - kProbePageFirst;
  const long long read_pages = probe_page_end(ws) - read_page_first(ws);
  const long long writes = static_cast<long long>(others) * pages;
  const long long reads = static_cast<long long>(others) * read_pages;
  const long long last_page = probe_page_end(ws) - 1;
  auto peer_of = [&](long long item) { return (ws.rank + 1 + static_cast<int>(item % others)) % ws.world; };
  // P5, first half: every store of this rank.
  for (long long i = threadIdx.x; i < writes; i += blockDim.x) {
    const int peer = peer_of(i);
    const long long page = kProbePageFirst + i / others;
    const bool dropped = peer == drop_peer && (drop_mode & kDropWrites) &&
                         (!(drop_mode & kDropLastPageOnly) || page == last_page);
    if (!dropped)
      store_volatile(ws.bases[peer] + write_place(page, ws.rank), probe_pattern(false, ws.rank, peer, page));
  }
  for (long long i = threadIdx.x; i < reads; i += blockDim.x) {
    const int reader = peer_of(i);
    const long long page = read_page_first(ws) + i / others;
    store_volatile(ws.bases[ws.rank] + read_place(ws, page, ws.rank, reader),
                   probe_pattern(true, ws.rank, reader, page));
  }
  __threadfence_system();
  __shared__ long long deadline;
  if (threadIdx.x == 0) deadline = static_cast<long long>(global_timer_ns()) + timeout_ns;
  __syncthreads();
  // P5, second half: every poll, P3 then P4.
  for (long long i = threadIdx.x; i < writes; i += blockDim.x) {
    const int peer = peer_of(i);
    const long long page = kProbePageFirst + i / others;
    const long long at = write_place(page, peer);
    char* mine = ws.bases[ws.rank] + at;
    const bool flags = at < kRegionsOffset;
    bool landed = false;
    uint4 v;
    for (unsigned int misses = 0;; ++misses) {
      v = load_volatile(mine);
      landed = flags ? (v.x | v.y | v.z | v.w) != 0u : !half_pack_has_empty(v);  // I3 per lane
      if (landed || static_cast<long long>(global_timer_ns()) > deadline) break;
      probe_backoff(misses);
    }
    if (!landed || !same_pack(v, probe_pattern(false, peer, ws.rank, page)))
      report(ws.ctrl, peer, 0, landed ? kProbeWrong : kProbeMissing, at);
    store_volatile(mine, flags ? make_uint4(0u, 0u, 0u, 0u) : empty_pack());  // P3
  }
  for (long long i = threadIdx.x; i < reads; i += blockDim.x) {
    const int owner = peer_of(i);
    const long long page = read_page_first(ws) + i / others;
    const long long at = read_place(ws, page, owner, ws.rank);
    char* theirs = ws.bases[owner] + at;
    const uint4 expect = probe_pattern(true, owner, ws.rank, page);
    const uint4 fill = empty_pack();
    bool seen = false, other = false;
    for (unsigned int misses = 0;; ++misses) {
      uint4 v = load_volatile(theirs);
      if (owner == drop_peer && (drop_mode & kDropReads)) v.x ^= kReadDropFlip;
      seen = same_pack(v, expect);
      other |= !seen && !same_pack(v, fill);
      if (seen || static_cast<long long>(global_timer_ns()) > deadline) break;
      probe_backoff(misses);
    }
    if (seen) store_volatile(theirs, fill);  // P4: its place alone
    else report(ws.ctrl, owner, 1, other ? kProbeReadWrong : kProbeReadMissing, at);
  }
  __threadfence_system();
}

}  // namespace

std::string probe_place_name(const WorkspaceView& v, long long at) {
  const std::string page = "the page at slab byte " + std::to_string(at / kProbePageBytes * kProbePageBytes);
  if (at < kCtrlBytes) return "the control block, " + page;
  if (at < kRegionsOffset) return "the flag area, " + page;
  if (at < v.pull_offset) {
    const long long parity = (at - kRegionsOffset) / v.region_bytes;
    const long long rel = (at - kRegionsOffset) % v.region_bytes;
    std::string where = "the push region of parity " + std::to_string(parity) + " (";
    if (rel < v.world * v.oneshot_slot_bytes)
      where += "one-shot slot " + std::to_string(rel / v.oneshot_slot_bytes) + ", ";
    return where + "chunk block " + std::to_string(rel / v.chunk_slot_bytes) + "), " + page;
  }
  if (at < areas_end(v)) {
    const long long parity = (at - v.pull_offset) / v.pull_region_bytes;
    const long long rel = (at - v.pull_offset) % v.pull_region_bytes;
    const char* parts[] = {"partial plane 0", "partial plane 1", "result"};
    const std::string part = rel < v.pull_input_bytes
                                 ? "input copy"
                                 : parts[std::min<long long>(2, (rel - v.pull_input_bytes) / v.chunk_slot_bytes)];
    return "the pull area of parity " + std::to_string(parity) + " (" + part + "), " + page;
  }
  return "the slab's last page, " + page;
}

std::string workspace_probe(Workspace* ws, long long timeout_ns, int drop_peer, int drop_mode, ProbeOutcomes* out) {
  ProbeOutcomes* device = &ws->view.ctrl->probe;
  cudaError_t err = cudaSetDevice(ws->device);
  if (err == cudaSuccess) err = cudaMemsetAsync(device->outcome, 0, sizeof(device->outcome), nullptr);
  if (err == cudaSuccess) err = cudaMemsetAsync(device->failed_at, 0xFF, sizeof(device->failed_at), nullptr);
  if (err == cudaSuccess) {
    probe_kernel<<<1, kProbeThreads, 0, nullptr>>>(ws->view, drop_peer, drop_mode, timeout_ns);
    err = cudaGetLastError();
  }
  // Pageable destination: the copy returns once the kernel and the copy are done (the legacy stream, in order).
  if (err == cudaSuccess) err = cudaMemcpy(out, device, sizeof(*out), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("data-path probe: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  }
  return "";
}

}  // namespace sgl_sm120
