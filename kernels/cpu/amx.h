// Intel AMX tiles for mlxcel's CPU kernels (bf16_tiles.cpp, decode_ops.cpp): present when the
// build targets a CPU with AMX-BF16 (-march=native on one), MLXCEL_AMX then set.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MLXCEL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace mlxcel {

// Linux hands AMX's tile state to a process only on request (arch_prctl, once per process).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tile registers 16 rows of 64 bytes. A thread's configuration may have been changed
// by other code since (torch's own kernels use AMX too), so each job sets it and releases it.
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace mlxcel
#endif
