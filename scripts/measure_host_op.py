"""Host cost per dispatched ATen op of eager PyTorch (forward + autograd backward) with tiny tensors:
the dispatch path without kernel work, on this machine's CPU."""
import time, torch
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))
lin = torch.nn.Linear(8, 8)
norm = torch.nn.LayerNorm(8)
x = torch.randn(4, 8)
def step():
    h = x
    for _ in range(16):
        h = h + torch.nn.functional.gelu(lin(norm(h))) * 0.5
    h.sum().backward()
for _ in range(50): step()
with Count(): step()
ops = Count.n
best = []
for _ in range(7):
    t = time.perf_counter(); [step() for _ in range(50)]; best.append((time.perf_counter() - t) / 50)
best.sort()
print(f"torch {torch.__version__}: {ops} ATen ops per step, median {best[3]*1e3:.3f} ms, {best[3]/ops*1e6:.2f} us per op")
