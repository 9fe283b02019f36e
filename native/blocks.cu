// Gather / scatter of whole KV blocks between a paged cache and a contiguous staging buffer.
// The cache is (num_blocks, block_bytes) bytes; the staging buffer is (n_ids, block_bytes).
// gather:  staging[i] = cache[ids[i]]      scatter: cache[ids[i]] = staging[i]
// The *_v16 variants move 16-byte words; use them when block_bytes and both base pointers are
// 16-byte aligned. Grid: x covers the words of one block (grid-stride), y walks the ids.
// No standard headers: NVRTC does not always ship them.

template <typename Word>
__device__ __forceinline__ void copy_blocks(const Word* __restrict__ src, Word* __restrict__ dst,
                                            const long long* __restrict__ ids, long long n_ids,
                                            long long block_words, bool gather) {
    for (long long i = blockIdx.y; i < n_ids; i += gridDim.y) {
        const long long block = ids[i];
        const Word* from = gather ? src + block * block_words : src + i * block_words;
        Word* to = gather ? dst + i * block_words : dst + block * block_words;
        for (long long w = blockIdx.x * (long long)blockDim.x + threadIdx.x; w < block_words;
             w += (long long)gridDim.x * blockDim.x) {
            to[w] = from[w];
        }
    }
}

extern "C" __global__ void gather_blocks_u8(const unsigned char* cache, unsigned char* staging,
                                            const long long* ids, long long n_ids,
                                            long long block_bytes) {
    copy_blocks<unsigned char>(cache, staging, ids, n_ids, block_bytes, true);
}

extern "C" __global__ void scatter_blocks_u8(const unsigned char* staging, unsigned char* cache,
                                             const long long* ids, long long n_ids,
                                             long long block_bytes) {
    copy_blocks<unsigned char>(staging, cache, ids, n_ids, block_bytes, false);
}

extern "C" __global__ void gather_blocks_v16(const uint4* cache, uint4* staging,
                                             const long long* ids, long long n_ids,
                                             long long block_words) {
    copy_blocks<uint4>(cache, staging, ids, n_ids, block_words, true);
}

extern "C" __global__ void scatter_blocks_v16(const uint4* staging, uint4* cache,
                                              const long long* ids, long long n_ids,
                                              long long block_words) {
    copy_blocks<uint4>(staging, cache, ids, n_ids, block_words, false);
}
