"""CPU time of the eager and the fused forms of one decoder layer's non-GEMM pieces (issue 32).

    python -m bench.dev.cpu_step_pieces [ROWS ...]     (default 32 2048: a decode batch, a prefill chunk)

One torch thread, random tensors of the `small` preset's shapes (hidden 768, intermediate
2304, 12 q / 4 kv heads of 64), each piece best of 3 runs of CPU time
(`time.process_time`): RMSNorm (the formula, `F.rms_norm`, `torch._fused_rms_norm`), o_proj
with the residual add after it or as a oneDNN post-op, the MLP (gate_up, silu x up, down,
add) eager / in place / with the activation, product and add as post-ops (what
transport/weights/cpu_linear.PackedSwiGLU and PackedLinear.add run), and q/k norm + rotary per
tensor or over q and k heads together. Prints each time and the fused forms' largest
difference from the eager ones. Imports nothing of EPD's: it measures torch and oneDNN.
"""
import sys, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
H, I, HQ, HKV, D = 768, 2304, 12, 4, 64
R = torch.ops.mkldnn._reorder_linear_weight
LP = torch.ops.mkldnn._linear_pointwise

def cpu(fn, reps):
    fn(); fn()
    best = []
    for _ in range(3):
        t = time.process_time()
        for _ in range(reps): fn()
        best.append((time.process_time() - t) / reps * 1e6)
    return min(best)

def eager_norm(x, w, eps=1e-6):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x

def rot_half(x):
    x1, x2 = x.chunk(2, dim=-1); return torch.cat((-x2, x1), dim=-1)

for N in [int(a) for a in sys.argv[1:]] or [32, 2048]:
    reps = max(5, 20000 // N)
    x = torch.randn(N, H); res = torch.randn(N, H); w = torch.randn(H)
    print(f"--- N={N}")
    print("norm eager   %8.1f us" % cpu(lambda: eager_norm(x, w), reps))
    print("F.rms_norm   %8.1f us" % cpu(lambda: F.rms_norm(x, (H,), w, 1e-6), reps))
    print("_fused_rms   %8.1f us" % cpu(lambda: torch._fused_rms_norm(x, [H], w, 1e-6), reps))
    print("  diff F.rms_norm %.2e" % (F.rms_norm(x, (H,), w, 1e-6) - eager_norm(x, w)).abs().max())
    print("  diff fused %.2e" % (torch._fused_rms_norm(x, [H], w, 1e-6)[0] - eager_norm(x, w)).abs().max())
    wo = R(torch.randn(H, HQ * D) * 0.02, None); o = torch.randn(N, HQ * D)
    print("o_proj + add %8.1f us" % cpu(lambda: res + LP(o, wo, None, "none", [], ""), reps))
    print("o_proj bin   %8.1f us" % cpu(lambda: LP.binary(o, res, wo, None, "add"), reps))
    wgu_t = torch.randn(2 * I, H) * 0.02
    wgu = R(wgu_t, None); wg = R(wgu_t[:I].contiguous(), None); wu = R(wgu_t[I:].contiguous(), None)
    wd = R(torch.randn(H, I) * 0.02, None)
    def mlp_eager():
        g, u = LP(x, wgu, None, "none", [], "").split(I, dim=-1)
        return res + LP(F.silu(g) * u, wd, None, "none", [], "")
    def mlp_inplace():
        gu = LP(x, wgu, None, "none", [], ""); g, u = gu.split(I, dim=-1)
        g = F.silu(g, inplace=True).mul_(u)
        return LP.binary(g, res, wd, None, "add")
    def mlp_fused():
        g = LP(x, wg, None, "swish", [], "")
        h = LP.binary(x, g, wu, None, "mul")
        return LP.binary(h, res, wd, None, "add")
    print("mlp eager    %8.1f us" % cpu(mlp_eager, reps))
    print("mlp inplace  %8.1f us" % cpu(mlp_inplace, reps))
    print("mlp fused    %8.1f us" % cpu(mlp_fused, reps))
    print("  diff fused %.2e" % (mlp_fused() - mlp_eager()).abs().max())
    # rotary + qk norm
    qkv = torch.randn(N, (HQ + 2 * HKV) * D); qw = torch.randn(D); kw = torch.randn(D)
    ang = torch.randn(N, D // 2); cos = torch.cat([ang.cos()] * 2, -1); sin = torch.cat([ang.sin()] * 2, -1)
    def rope_eager():
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q = eager_norm(q.view(N, HQ, D), qw); k = eager_norm(k.view(N, HKV, D), kw)
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rot_half(q) * s, k * c + rot_half(k) * s
    wqk = torch.cat([qw.expand(HQ, D), kw.expand(HKV, D)])  # [HQ+HKV, D]
    ch, sh = cos[:, None, :D // 2].contiguous(), sin[:, None, :D // 2].contiguous()
    def rope_fused():
        qk = qkv[:, :(HQ + HKV) * D].view(N, HQ + HKV, D)
        qk = F.rms_norm(qk, (D,), None, 1e-6).mul_(wqk)  # [N, Hq+Hkv, D] new tensor
        x1, x2 = qk[..., :D // 2], qk[..., D // 2:]
        out = torch.empty_like(qk)
        o1, o2 = out[..., :D // 2], out[..., D // 2:]
        torch.mul(x1, ch, out=o1); o1.sub_(x2 * sh)
        torch.mul(x2, ch, out=o2); o2.add_(x1 * sh)
        return out[:, :HQ], out[:, HQ:]
    def rope_fused2():
        qk = qkv[:, :(HQ + HKV) * D].view(N, HQ + HKV, D)
        qk = F.rms_norm(qk, (D,), None, 1e-6).mul_(wqk)
        x1, x2 = qk.chunk(2, dim=-1)
        out = torch.cat((x1 * ch - x2 * sh, x2 * ch + x1 * sh), dim=-1)
        return out[:, :HQ], out[:, HQ:]
    print("rope eager   %8.1f us" % cpu(rope_eager, reps))
    print("rope fused   %8.1f us" % cpu(rope_fused, reps))
    print("rope fused2  %8.1f us" % cpu(rope_fused2, reps))
    a, b = rope_eager(), rope_fused()
    print("  diff %.2e %.2e" % ((a[0] - b[0]).abs().max(), (a[1] - b[1]).abs().max()))
