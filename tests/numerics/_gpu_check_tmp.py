import torch
from mpfa.kernels import *
print(torch.__version__, torch.cuda.get_device_name())
g = torch.Generator().manual_seed(1)
codes = torch.randint(0, 16, (4, 32), generator=g, dtype=torch.uint8)
for dev in ("cpu",):
    try:
        f = pack_e2m1(codes).to(dev).view(torch.float4_e2m1fn_x2).to(torch.float32)
        print(dev, "fp4 conversion", f.shape, torch.equal(f.cpu().reshape(codes.shape), decode_e2m1(codes)))
    except Exception as e:
        print(dev, "fp4 conversion unsupported:", str(e)[:100])
x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 64)[:, None]
a, b = quantize_nvfp4(x), quantize_nvfp4(x.cuda())
print("nvfp4 bit-exact cpu==cuda", torch.equal(a.codes, b.codes.cpu()), torch.equal(a.scales.view(torch.uint8), b.scales.cpu().view(torch.uint8)))
print("fp8 bit-exact", torch.equal(quantize_fp8(x * 10).view(torch.uint8), quantize_fp8(x.cuda() * 10).cpu().view(torch.uint8)))
p = torch.rand(100000, generator=g)
print("p fp8 bit-exact", torch.equal(fake_quant_p_fp8(p), fake_quant_p_fp8(p.cuda()).cpu()))
cu_q, cu_k = torch.tensor([0, 33, 34, 200]), torch.tensor([0, 100, 101, 300])
q = torch.randn(200, 8, 128, generator=g).bfloat16(); k = (torch.randn(300, 2, 128, generator=g) + 3).bfloat16(); v = torch.randn(300, 2, 128, generator=g).bfloat16()
ref = attention_float64(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
for name in VARIANTS:
    o1 = attention(q, k, v, variant=name, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o2 = attention(q.cuda(), k.cuda(), v.cuda(), variant=name, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).cpu()
    print(name, "finite", bool(torch.isfinite(o2).all()), "cpu-vs-cuda rel", float((o1 - o2).norm() / o1.norm()), "err", float((o2.double() - ref).norm() / ref.norm()))
qd = q[:3]; means = SmoothingMeans(torch.randn(3, 8, 128), torch.randn(3, 2, 128))
d1 = decode(qd, k, v, variant="mpfa", cu_seqlens_k=cu_k, means=means, partition_size=128)
d2 = decode(qd.cuda(), k.cuda(), v.cuda(), variant="mpfa", cu_seqlens_k=cu_k, means=means, partition_size=128).cpu()
print("decode cpu-vs-cuda", float((d1 - d2).norm() / d1.norm()))
