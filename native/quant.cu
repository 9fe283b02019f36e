// Asymmetric min/max group quantization along the last axis, int8 or packed int4.
// x is (n_groups * group) float32, one group after another. Per group:
//   mn = min(x), s = (max(x) - mn) / qmax (1 when the group is constant),
//   q = clamp(rint((x - mn) / s), 0, qmax), stored as bytes (int4: two per byte, even index
//   in the low nibble). Dequantize: x' = q * s + mn.
// The arithmetic matches the torch reference in ucm/ops/quant.py bit for bit: IEEE division,
// round-half-even, and explicit _rn intrinsics so the compiler does not contract into an FMA.
// One thread per group (groups are 16-256 values); grid-stride over groups.

extern "C" __global__ void quantize_groups(const float* __restrict__ x,
                                           unsigned char* __restrict__ q,
                                           float* __restrict__ scale, float* __restrict__ minimum,
                                           long long n_groups, int group, int bits) {
    const float qmax = (float)((1 << bits) - 1);
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < n_groups;
         g += (long long)gridDim.x * blockDim.x) {
        const float* xs = x + g * group;
        float mn = xs[0], mx = xs[0];
        for (int i = 1; i < group; ++i) {
            mn = fminf(mn, xs[i]);
            mx = fmaxf(mx, xs[i]);
        }
        float s = __fdiv_rn(__fsub_rn(mx, mn), qmax);
        if (s == 0.0f) s = 1.0f;
        scale[g] = s;
        minimum[g] = mn;
        if (bits == 8) {
            unsigned char* qs = q + g * group;
            for (int i = 0; i < group; ++i) {
                float v = rintf(__fdiv_rn(__fsub_rn(xs[i], mn), s));
                qs[i] = (unsigned char)fminf(fmaxf(v, 0.0f), qmax);
            }
        } else {
            unsigned char* qs = q + g * (group / 2);
            for (int i = 0; i < group; i += 2) {
                float lo = rintf(__fdiv_rn(__fsub_rn(xs[i], mn), s));
                float hi = rintf(__fdiv_rn(__fsub_rn(xs[i + 1], mn), s));
                unsigned int l = (unsigned int)fminf(fmaxf(lo, 0.0f), qmax);
                unsigned int h = (unsigned int)fminf(fmaxf(hi, 0.0f), qmax);
                qs[i / 2] = (unsigned char)(l | (h << 4));
            }
        }
    }
}

extern "C" __global__ void dequantize_groups(const unsigned char* __restrict__ q,
                                             const float* __restrict__ scale,
                                             const float* __restrict__ minimum,
                                             float* __restrict__ x, long long n_values, int group,
                                             int bits) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_values;
         i += (long long)gridDim.x * blockDim.x) {
        const long long g = i / group;
        unsigned int v;
        if (bits == 8) {
            v = q[i];
        } else {
            const unsigned char b = q[i / 2];
            v = (i & 1) ? (b >> 4) : (b & 15u);
        }
        x[i] = __fadd_rn(__fmul_rn((float)v, scale[g]), minimum[g]);
    }
}
