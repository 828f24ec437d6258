"""RMSNorm forward in Triton; backward in PyTorch (enough for training)."""
import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8) for w in (2, 4, 8)],
    key=["n_rows", "D"])
@triton.jit
def rmsnorm_fwd(x_ptr, w_ptr, y_ptr, n_rows, D, eps, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask_c = cols < D
    w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    for r in range(ROWS):
        row = pid * ROWS + r
        if row < n_rows:
            x = tl.load(x_ptr + row * D + cols, mask=mask_c, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask_c)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty_like(x2)
        n_rows, D = x2.shape
        grid = lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)  # noqa: E731
        rmsnorm_fwd[grid](x2, weight, y, n_rows, D, eps, BLOCK_D=triton.next_power_of_2(D))
        ctx.save_for_backward(x2, weight)
        ctx.eps = eps
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xf = x.detach().float().requires_grad_()
            wf = weight.detach().float().requires_grad_()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps) * wf
            dx, dw = torch.autograd.grad(y, (xf, wf), dy.reshape(y.shape).float())
        return dx.to(x.dtype).view(dy.shape), dw.to(weight.dtype), None


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return RMSNormFn.apply(x, self.weight, self.eps)
