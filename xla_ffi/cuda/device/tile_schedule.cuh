// Tile schedulers: the grouped raster of (row tile, column tile) and the persistent kernel's tile pairs per
// cluster.
#pragma once

namespace jaxbnn::cuda {

// Grouped raster over (row tiles, column tiles): 8 row tiles share a band of column tiles for L2 reuse.
__device__ __forceinline__ void TileCoordinates(int pid, int m_tiles, int n_tiles, int& tile_m, int& tile_n) {
  constexpr int kGroup = 8;
  const int group = pid / (kGroup * n_tiles);
  const int first_m = group * kGroup;
  const int group_size = min(m_tiles - first_m, kGroup);
  const int in_group = pid % (kGroup * n_tiles);
  tile_m = first_m + in_group % group_size;
  tile_n = in_group / group_size;
}

// The tile pairs of one cluster of the persistent wgmma kernel, in order: pairs first, first + step, ...
// below end. `runs`: a contiguous run of pairs in column-tile-major order (problems whose operands sit in
// L2 together), so that a CTA keeps its column tile, and the column table staged for it, over most of its
// tiles; otherwise every ClusterCount-th pair of the grouped raster, so that the clusters working at one
// time share row and column tiles in L2.
struct PairRange {
  int first, end, step;
};
__device__ __forceinline__ PairRange PairsOfCluster(int cluster, int clusters, int m_pairs, int n_tiles, bool runs) {
  const long long pairs = static_cast<long long>(m_pairs) * n_tiles;
  if (!runs) return {cluster, static_cast<int>(pairs), clusters};
  return {static_cast<int>(cluster * pairs / clusters), static_cast<int>((cluster + 1) * pairs / clusters), 1};
}
__device__ __forceinline__ void PairCoordinates(int pair, int m_pairs, int n_tiles, bool runs, int& pair_m,
                                                int& tile_n) {
  if (runs) {
    tile_n = pair / m_pairs;
    pair_m = pair - tile_n * m_pairs;
  } else {
    TileCoordinates(pair, m_pairs, n_tiles, pair_m, tile_n);
  }
}

}  // namespace jaxbnn::cuda
