// Host-only check of the data-path probe's places and tags (csrc/probe.cu P1, P2), built and run by
// tests/test_probe_places.py: the places decide whether the one probe round can pass on a healthy fabric (two
// senders or readers on one place would take each other's pack) and whether it reaches every page a peer uses, and
// none of it needs a GPU.
// One translation unit with the sources, so their internal helpers (scratch_sizes, write_place) are in reach.
#include <cstdio>
#include <set>
#include <string>
#include <tuple>

#include "../csrc/probe.cu"
#include "../csrc/workspace.cu"

namespace sgl_sm120 {
// workspace.cu's creation path calls it (it lives with the kernels); never reached here.
cudaError_t query_cluster_capacity(int, int, int, int*) { return cudaErrorNotSupported; }
}  // namespace sgl_sm120

namespace {

int failures = 0;

void fail(const std::string& what, int world, long long max_numel, long long at) {
  if (++failures <= 20)
    std::printf("FAIL %s: world %d max_numel %lld slab offset %lld\n", what.c_str(), world, max_numel, at);
}

bool has_empty_half(uint4 v) {
  for (uint32_t w : {v.x, v.y, v.z, v.w})
    if ((w & 0xFFFFu) == sgl_sm120::kEmptyHalf || (w >> 16) == sgl_sm120::kEmptyHalf) return true;
  return false;
}

void check(int world, long long max_numel, const sgl_sm120::Topology& islands) {
  using namespace sgl_sm120;
  Topology flat{};
  flat.island_size = world;
  flat.num_islands = 1;
  const ScratchSizes z = scratch_sizes(world, max_numel, max_numel, flat, islands);
  WorkspaceView v{};
  v.world = world;
  v.region_bytes = z.region;
  v.oneshot_slot_bytes = z.oneshot_slot;
  v.chunk_slot_bytes = z.chunk_slot;
  v.pull_offset = kRegionsOffset + 2 * z.region;
  v.pull_region_bytes = z.pull_region;
  v.pull_input_bytes = z.pull_input;
  v.flat = flat;
  v.islands = islands;
  const long long first = kProbePageFirst, end = probe_page_end(v), reads_from = read_page_first(v);
  // Coverage: the write pages are every page after the Ctrl head up to the slab's end, the read pages every page
  // holding pull-area bytes.
  if (first * kProbePageBytes != kCtrlBytes) fail("write pages start elsewhere than after the Ctrl", world, max_numel, 0);
  if (end * kProbePageBytes != z.slab) fail("write pages end elsewhere than at the slab's end", world, max_numel, 0);
  if (reads_from * kProbePageBytes > v.pull_offset || (reads_from + 1) * kProbePageBytes <= v.pull_offset)
    fail("read pages start elsewhere than at the pull areas' first page", world, max_numel, v.pull_offset);
  for (int owner = 0; owner < world; ++owner) {
    std::set<long long> used;  // every place in this rank's slab, writes and reads (P1)
    auto place = [&](long long at, long long page, const char* kind) {
      if (at % kPackBytes != 0) fail(std::string(kind) + " place misaligned", world, max_numel, at);
      if (at < page * kProbePageBytes || at + kPackBytes > (page + 1) * kProbePageBytes)
        fail(std::string(kind) + " place outside its page", world, max_numel, at);
      if (at < kCtrlBytes || at + kPackBytes > z.slab) fail(std::string(kind) + " place outside the scratch", world,
                                                            max_numel, at);
      if (!used.insert(at).second) fail(std::string(kind) + " place shared", world, max_numel, at);
    };
    for (long long page = first; page < end; ++page)
      for (int sender = 0; sender < world; ++sender)
        if (sender != owner) place(write_place(page, sender), page, "write");
    for (long long page = reads_from; page < end; ++page)
      for (int reader = 0; reader < world; ++reader)
        if (reader != owner) place(read_place(v, page, owner, reader), page, "read");
    // P2: tags distinct per (kind, from, to, page) among the packs this slab sees, none empty or all zero.
    std::set<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> tags;
    for (long long page = first; page < end; ++page)
      for (int peer = 0; peer < world; ++peer) {
        if (peer == owner) continue;
        for (const uint4 t : {probe_pattern(false, peer, owner, page), probe_pattern(true, owner, peer, page)}) {
          if (has_empty_half(t) || (t.x | t.y | t.z | t.w) == 0u) fail("a tag reads as empty", world, max_numel, page);
          if (!tags.insert({t.x, t.y, t.z, t.w}).second) fail("two places share a tag", world, max_numel, page);
        }
      }
  }
  // Names of the places the host reports.
  const auto named = [&](long long at, const char* want) {
    if (probe_place_name(v, at).find(want) == std::string::npos)
      fail("place named '" + probe_place_name(v, at) + "', not '" + want + "'", world, max_numel, at);
  };
  named(kCtrlBytes, "the flag area");
  named(kRegionsOffset, "the push region of parity 0 (one-shot slot 0, chunk block 0)");
  named(kRegionsOffset + z.region + z.oneshot_slot, "the push region of parity 1 (one-shot slot 1,");
  named(v.pull_offset, "the pull area of parity 0 (input copy)");
  named(v.pull_offset + z.pull_region + z.pull_input, "the pull area of parity 1 (partial plane 0)");
  named(v.pull_offset + 2 * z.pull_region - kPackBytes, "the pull area of parity 1 (result)");
}

}  // namespace

int main() {
  using namespace sgl_sm120;
  const long long sizes[] = {8, 64, 3 * 7168, 64 * 7168, 1 << 20, (1 << 20) + 8};
  for (int world : {2, 4, 8}) {
    for (long long n : sizes) {
      Topology none{};
      check(world, n, none);
      if (world == 8) {
        Topology two{};  // two islands of four, as at 8 ranks over two switches
        two.island_size = 4;
        two.num_islands = 2;
        check(world, n, two);
      }
    }
  }
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
