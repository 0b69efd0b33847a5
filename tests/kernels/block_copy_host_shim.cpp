// Runs the kernels of block_copy.cu on the CPU, one (block, thread) at a time, so that CI
// without a GPU still checks their indexing.  The kernels share no memory and never
// synchronise, so running the threads one after another gives the bytes a GPU would.
// Build: g++ -shared -fPIC -DKV_SOURCE='"path/to/block_copy.cu"' block_copy_host_shim.cpp
#include <cstring>

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(threads)

namespace {
struct Dim3 {
    unsigned x, y, z;
};
Dim3 blockIdx, threadIdx, blockDim, gridDim;
}  // namespace

#include KV_SOURCE

namespace {
typedef void (*Kernel)(const long long*, int, long long, int);
struct Entry {
    const char* name;
    Kernel kernel;
};
const Entry kKernels[] = {
    {"kv_gather_v16", kv_gather_v16}, {"kv_gather_v8", kv_gather_v8},
    {"kv_gather_v4", kv_gather_v4},   {"kv_gather_v1", kv_gather_v1},
    {"kv_scatter_v16", kv_scatter_v16}, {"kv_scatter_v8", kv_scatter_v8},
    {"kv_scatter_v4", kv_scatter_v4},   {"kv_scatter_v1", kv_scatter_v1},
};
}  // namespace

extern "C" int run_kernel(const char* name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                          unsigned threads, const long long* meta, int n_segs, long long seg_vecs,
                          int n_blocks) {
    for (const Entry& entry : kKernels) {
        if (std::strcmp(entry.name, name) != 0) continue;
        gridDim = {grid_x, grid_y, grid_z};
        blockDim = {threads, 1, 1};
        for (unsigned z = 0; z < grid_z; ++z)
            for (unsigned y = 0; y < grid_y; ++y)
                for (unsigned x = 0; x < grid_x; ++x)
                    for (unsigned t = 0; t < threads; ++t) {
                        blockIdx = {x, y, z};
                        threadIdx = {t, 0, 0};
                        entry.kernel(meta, n_segs, seg_vecs, n_blocks);
                    }
        return 0;
    }
    return -1;
}
