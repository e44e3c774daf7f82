"""The Triton source of ``lora_core.ops.nf4_matmul`` (its docstring gives the arithmetic); imported only on a GPU.

``code_value`` is the NF4 table as a tree of selects on a code's four bits with the table's values as fp32
constants (``lora_core.nf4.NF4_CODE``, written out: Triton cannot index a Python tuple with a tensor); a lookup
from a 16-entry table in memory per element ran 1.3x slower on an H100.
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # imported only by nf4_matmul's first launch
    raise ImportError(
        f"lora_core.ops.nf4_matmul is a Triton kernel and triton does not import ({exc}); it comes with torch's "
        "CUDA wheels on Linux (pip install triton)"
    ) from exc
try:
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - Triton before 3.0 kept it here
    from triton.language.extra import libdevice


@triton.jit
def code_value(c):
    b0, b1, b2, b3 = (c & 1) != 0, (c & 2) != 0, (c & 4) != 0, (c & 8) != 0
    p0 = tl.where(b0, -0.6961928009986877, -1.0)
    p1 = tl.where(b0, -0.39491748809814453, -0.5250730514526367)
    p2 = tl.where(b0, -0.18477343022823334, -0.28444138169288635)
    p3 = tl.where(b0, 0.0, -0.09105003625154495)
    p4 = tl.where(b0, 0.16093020141124725, 0.07958029955625534)
    p5 = tl.where(b0, 0.33791524171829224, 0.24611230194568634)
    p6 = tl.where(b0, 0.5626170039176941, 0.44070982933044434)
    p7 = tl.where(b0, 1.0, 0.7229568362236023)
    q0, q1 = tl.where(b1, p1, p0), tl.where(b1, p3, p2)
    q2, q3 = tl.where(b1, p5, p4), tl.where(b1, p7, p6)
    return tl.where(b3, tl.where(b2, q3, q2), tl.where(b2, q1, q0))


@triton.jit
def block_absmax(blk, n_ok, am_ptr, q_ptr, s_ptr, mean, dcode_ptr, FORM: tl.constexpr):
    """fp32 absmax of NF4 blocks ``blk`` as ``lora_core.nf4`` recovers it (each multiply and add rounded alone)."""
    if FORM == 0:
        am = tl.load(am_ptr + blk, mask=n_ok, other=0.0)
    elif FORM == 1:  # lora_core's int8 double quantisation: q · (s / 127) + μ
        qv = tl.load(q_ptr + blk, mask=n_ok, other=0).to(tl.float32)
        step = libdevice.div_rn(tl.load(s_ptr + blk // 256, mask=n_ok, other=0.0), 127.0)
        am = libdevice.add_rn(libdevice.mul_rn(qv, step), mean)
    else:  # bitsandbytes' nested absmax: d[q] · s + μ, q an unsigned index
        qi = tl.load(q_ptr + blk, mask=n_ok, other=0).to(tl.int32) & 0xFF
        d = tl.load(dcode_ptr + qi, mask=n_ok, other=0.0)
        am = libdevice.add_rn(libdevice.mul_rn(d, tl.load(s_ptr + blk // 256, mask=n_ok, other=0.0)), mean)
    return am


@triton.jit
def nf4_matmul(
    x_ptr, p_ptr, am_ptr, q_ptr, s_ptr, mean, dcode_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    FORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, LOOKUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * n_n  # GROUP_M row blocks of x run together and share their W columns in L2
    first_m = (pid // group) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rh = tl.arange(0, 32)  # byte j of a K-step holds k0 + 2j (high nibble) and k0 + 2j + 1 (low)
    rk = tl.arange(0, 64)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, 64):
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + k0 + rk[None, :], mask=m_ok[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xt, (BM, 32, 2)))  # (BM, 32) each: columns k0 + 2j and k0 + 2j + 1
        packed = tl.load(p_ptr + rn[None, :] * (K // 2) + k0 // 2 + rh[:, None], mask=n_ok[None, :], other=0)
        am = block_absmax(rn * (K // 64) + k0 // 64, n_ok, am_ptr, q_ptr, s_ptr, mean, dcode_ptr, FORM)
        hi = (packed >> 4).to(tl.int32)
        lo = (packed & 0xF).to(tl.int32)
        if LOOKUP:
            v_even, v_odd = code_value(hi), code_value(lo)
        else:  # the nibble itself: wrong values, a timing bound of the lookup's cost (nf4_matmul.bound_matmul)
            v_even, v_odd = hi.to(tl.float32), lo.to(tl.float32)
        acc = tl.dot(x_even, (v_even * am[None, :]).to(xt.dtype), acc)  # (32, BN) Ŵᵀ rows, one rounding each
        acc = tl.dot(x_odd, (v_odd * am[None, :]).to(xt.dtype), acc)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def nf4_matmul_wa(
    x_ptr, p_ptr, am_ptr, q_ptr, s_ptr, mean, dcode_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    FORM: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """yᵀ tile (BN, BM) = Ŵ tile (BN, K) · xᵀ (K, BM): the dequantised weight is the product's *first* operand, which
    Hopper's tensor cores may read from registers, so the unpacked tile need not pass through shared memory (the
    kernel above makes it the second operand, which they read from shared memory only). SPLIT: two products of 32
    (even and odd columns of x, as above) instead of one of 64 on the weight's interleaved halves."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    pid_m, pid_n = pid % n_m, pid // n_m  # the token blocks of one weight block run together: its codes read once
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rh = tl.arange(0, 32)
    rk = tl.arange(0, 64)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, 64):
        packed = tl.load(p_ptr + rn[:, None] * (K // 2) + k0 // 2 + rh[None, :], mask=n_ok[:, None], other=0)
        am = block_absmax(rn * (K // 64) + k0 // 64, n_ok, am_ptr, q_ptr, s_ptr, mean, dcode_ptr, FORM)
        w_hi = (code_value((packed >> 4).to(tl.int32)) * am[:, None]).to(x_ptr.dtype.element_ty)  # (BN, 32)
        w_lo = (code_value((packed & 0xF).to(tl.int32)) * am[:, None]).to(x_ptr.dtype.element_ty)
        if SPLIT:
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + k0 + rk[None, :], mask=m_ok[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(xt, (BM, 32, 2)))
            acc = tl.dot(w_hi, tl.trans(x_even), acc)
            acc = tl.dot(w_lo, tl.trans(x_odd), acc)
        else:
            xk = tl.load(x_ptr + rm[None, :] * stride_xm + k0 + rk[:, None], mask=m_ok[None, :], other=0.0)
            acc = tl.dot(tl.interleave(w_hi, w_lo), xk, acc)  # (BN, 64) · (64, BM)
    out = y_ptr + rm[None, :] * stride_ym + rn[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
