// Block scoring for sparse attention and a per-row top-k.
// q is (Hq, D); block representatives are (Hkv, nb, D); out is (Hq, nb). Query head h reads
// KV head h / (Hq / Hkv) (grouped-query attention).
//   quest_scores:  out = sum_i q_i * center_i + |q_i| * radius_i
//                  (= sum_i max(q_i * kmax_i, q_i * kmin_i) with center/radius of [kmin, kmax]:
//                  an upper bound of q.k for every key of the block)
//   mean_scores:   out = sum_i q_i * kmean_i
// topk_rows: for each row of a (rows, n) score matrix, the k largest entries' indices in
// descending score order, ties to the lower index. One CUDA block per row; the row is staged in
// shared memory (n <= TOPK_MAX_N, k <= n) and k rounds of a block-wide argmax pick the
// winners; a picked entry becomes NaN so it never wins again. NaN scores are never picked.

#define TOPK_MAX_N 8192
#define TOPK_THREADS 256

extern "C" __global__ void quest_scores(const float* __restrict__ q,
                                        const float* __restrict__ center,
                                        const float* __restrict__ radius,
                                        float* __restrict__ out, int hq, int hkv, int nb, int d) {
    const int group = hq / hkv;
    const long long total = (long long)hq * nb;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const int h = (int)(t / nb);
        const int b = (int)(t % nb);
        const float* qh = q + (long long)h * d;
        const long long base = ((long long)(h / group) * nb + b) * d;
        float acc = 0.0f;
        for (int i = 0; i < d; ++i) {
            acc += qh[i] * center[base + i] + fabsf(qh[i]) * radius[base + i];
        }
        out[t] = acc;
    }
}

extern "C" __global__ void mean_scores(const float* __restrict__ q, const float* __restrict__ kmean,
                                       float* __restrict__ out, int hq, int hkv, int nb, int d) {
    const int group = hq / hkv;
    const long long total = (long long)hq * nb;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const int h = (int)(t / nb);
        const int b = (int)(t % nb);
        const float* qh = q + (long long)h * d;
        const float* kb = kmean + ((long long)(h / group) * nb + b) * d;
        float acc = 0.0f;
        for (int i = 0; i < d; ++i) acc += qh[i] * kb[i];
        out[t] = acc;
    }
}

extern "C" __global__ void topk_rows(const float* __restrict__ scores, long long* __restrict__ idx,
                                     int n, int k) {
    __shared__ float row[TOPK_MAX_N];
    __shared__ float best_v[TOPK_THREADS];
    __shared__ int best_i[TOPK_THREADS];
    const float* src = scores + (long long)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = src[i];
    __syncthreads();
    for (int r = 0; r < k; ++r) {
        float v = -INFINITY;
        int vi = n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (row[i] > v || (row[i] == v && i < vi)) {
                v = row[i];
                vi = i;
            }
        }
        best_v[threadIdx.x] = v;
        best_i[threadIdx.x] = vi;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
            if (threadIdx.x < stride) {
                const float ov = best_v[threadIdx.x + stride];
                const int oi = best_i[threadIdx.x + stride];
                if (ov > best_v[threadIdx.x] ||
                    (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                    best_v[threadIdx.x] = ov;
                    best_i[threadIdx.x] = oi;
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            idx[(long long)blockIdx.x * k + r] = best_i[0];
            // NaN never compares as a winner; best_i == n only when the rest are NaN
            if (best_i[0] < n) row[best_i[0]] = __int_as_float(0x7fffffff);
        }
        __syncthreads();
    }
}
