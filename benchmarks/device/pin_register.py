"""Page-locking N GiB of host memory for sleep mode's host copy: ``torch.empty(pin_memory=True)``
(cudaHostAlloc, as ``ModelRunner.sleep`` does) against pageable memory first touched by T
threads and then registered (cudaHostRegister). Prints seconds of each, of a copy into it and
back, and of unlocking and freeing it (what waking the weights pays after the copy).

    python3 benchmarks/device/pin_register.py [GiB] [threads]
"""

import sys
import threading
import time

import torch

n = int(float(sys.argv[1] if len(sys.argv) > 1 else 15) * 2**30)
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 16
dev = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
torch.cuda.synchronize()

start = time.perf_counter()
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
print(f"cudaHostAlloc                     {time.perf_counter() - start:7.3f} s")
del pinned

start = time.perf_counter()
host = torch.empty(n, dtype=torch.uint8)
parts = host.chunk(threads)
workers = [threading.Thread(target=p.zero_) for p in parts]
for w in workers:
    w.start()
for w in workers:
    w.join()
touched = time.perf_counter()
rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
registered = time.perf_counter()
print(f"touch ({threads} threads)                {touched - start:7.3f} s")
print(f"cudaHostRegister (rc {int(rc)})          {registered - touched:7.3f} s")
host.copy_(dev, non_blocking=True)
torch.cuda.synchronize()
copied = time.perf_counter()
print(f"copy into it                      {copied - registered:7.3f} s")
dev.copy_(host, non_blocking=True)
torch.cuda.synchronize()
back = time.perf_counter()
print(f"copy back from it                 {back - copied:7.3f} s")
torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
unregistered = time.perf_counter()
print(f"cudaHostUnregister                {unregistered - back:7.3f} s")
del host, parts
print(f"free                              {time.perf_counter() - unregistered:7.3f} s")
