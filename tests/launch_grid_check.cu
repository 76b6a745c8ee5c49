// Host-only: the launch grids of csrc/ar_launch.h (plain_grid, fused_row_grid, fused_cluster_grid, which the
// launches in ar_kernels.cu use) for the inputs read from stdin, one query a line, one answer a line. Run by
// tests/test_policy.py, which holds sgl_kernel_sm120/policy.py's plain_grid and fused_grid to these answers.
//   plain NUM_PACKS THREADS CTAS      -> "BLOCKS THREADS"
//   row ROWS CTAS                     -> "BLOCKS"
//   cluster ROWS CLUSTER CTAS CAPACITY -> "BLOCKS"
#include <cstdio>
#include <cstring>

#include "../csrc/ar_launch.h"

int main() {
  using namespace sgl_sm120;
  char kind[16];
  while (std::scanf("%15s", kind) == 1) {
    if (std::strcmp(kind, "plain") == 0) {
      long long packs;
      int threads, ctas;
      if (std::scanf("%lld %d %d", &packs, &threads, &ctas) != 3) return 2;
      const Grid grid = plain_grid(packs, threads, ctas);
      std::printf("%d %d\n", grid.blocks, grid.threads);
    } else if (std::strcmp(kind, "row") == 0) {
      int rows, ctas;
      if (std::scanf("%d %d", &rows, &ctas) != 2) return 2;
      std::printf("%d\n", fused_row_grid(rows, ctas));
    } else if (std::strcmp(kind, "cluster") == 0) {
      int rows, cluster, ctas, capacity;
      if (std::scanf("%d %d %d %d", &rows, &cluster, &ctas, &capacity) != 4) return 2;
      std::printf("%d\n", fused_cluster_grid(rows, cluster, ctas, capacity));
    } else {
      return 2;
    }
  }
  return 0;
}
