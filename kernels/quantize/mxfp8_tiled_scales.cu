// The weights' scales in the swap-AB GEMM's tile order (launch_tile_mxfp8_scales, mxfp8.hpp): made
// once per weight update, so that each stage of a tile brings its 128 rows' scale words with one
// 512-byte copy instead of 128 copies of 4 bytes from rows cols / 32 bytes apart.
#include <cstdint>

#include "kernels/common/alignment.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

static_assert(kMxStageBlocks == 4, "a tiled word holds a stage's 4 scale bytes of one row");
// Padding bytes (rows past the weight's, blocks past its columns) are scales of 1: the swap-AB GEMM
// reads padding rows' words like any other and decodes a thread's scales the slow way when one of
// its words holds a 0 or 0xFF byte (their results are never stored, so only the speed depends on it).
constexpr uint8_t kPadding = 0x7f;

// One thread per word of the tiled copy: word w is row (w % 128) of tile w / 128 in the order
// (group, row tile, stage); a word is a row's kMxStageBlocks scale bytes of the stage. Writes are whole warps of consecutive words; each word's 4 bytes are
// read from the row's scales (any alignment: cols / 32 need not be a multiple of 4).
__global__ void tile_scales_kernel(const uint8_t* scales, uint32_t* tiled, int64_t rows, int64_t blocks,
                                   int64_t row_tiles, int64_t stages, int64_t words) {
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < words;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r_in = w % kMxTileRows, tile = w / kMxTileRows;
    const int64_t stage = tile % stages, row_tile = tile / stages % row_tiles, group = tile / stages / row_tiles;
    const int64_t r = row_tile * kMxTileRows + r_in;
    uint32_t word = 0;
    const uint8_t* row = scales + (group * rows + r) * blocks;
    for (int b = 0; b < kMxStageBlocks; ++b) {
      const int64_t j = stage * kMxStageBlocks + b;
      word |= static_cast<uint32_t>(r < rows && j < blocks ? row[j] : kPadding) << (8 * b);
    }
    tiled[w] = word;
  }
}

}  // namespace

void launch_tile_mxfp8_scales(const uint8_t* scales, uint8_t* tiled, int groups, int64_t rows, int64_t cols,
                              cudaStream_t stream) {
  constexpr const char* kWho = "launch_tile_mxfp8_scales";
  MG_CHECK(groups >= 1 && rows >= 1 && cols > 0 && cols % kMxBlock == 0, kWho,
           ": needs groups and rows >= 1 and cols a positive multiple of 32, got ", groups, " x ", rows, " x ", cols);
  MG_CHECK(scales != nullptr && tiled != nullptr && aligned16(scales) && aligned16(tiled), kWho,
           ": scales and tiled must be 16-byte aligned device pointers");
  const int64_t words = mxfp8_tiled_scale_bytes(groups, rows, cols) / 4;
  constexpr int kThreads = 256;
  const int64_t blocks_needed = (words + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks_needed < 4096 ? blocks_needed : 4096);  // grid-stride beyond
  tile_scales_kernel<<<grid, kThreads, 0, stream>>>(scales, reinterpret_cast<uint32_t*>(tiled), rows,
                                                    cols / kMxBlock, (rows + kMxTileRows - 1) / kMxTileRows,
                                                    (cols + kMxStageCols - 1) / kMxStageCols, words);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
