"""docs/protocol.md section 7 rebuilt with minips's own encoders: a PUSH at clock 7 of a sparse
gradient (indices 3 and 17, values 0.5 and -1.25 as f32), printed as the page's hex dump.
Lab 1 of docs/course/ decodes it by hand, then changes the index scheme or the numbers.

Usage: python examples/worked_example.py [u32|varint]   (u32, the page's: 155 bytes)
"""

import sys

import numpy as np

from minips.sparse import SparseVector, encode_vector
from minips.wire import frames, messages


def worked_push(index: str = "u32") -> bytes:
    """The frame of section 7: prefix, buffer table, msgpack map, indices, values."""
    grad = SparseVector(np.array([3, 17], np.uint32), np.array([0.5, -1.25], np.float32), 20)
    payload = encode_vector(grad, index=index)  # a worker's default index scheme is varint
    push = messages.Push(clock=7, step_time=0.25, loss=1.5, samples=64, payload=payload)
    return b"".join(bytes(part) for part in frames.encode(push))


if __name__ == "__main__":
    frame = worked_push(*sys.argv[1:2])
    for at in range(0, len(frame), 16):
        print(f"{at:04x}  {frame[at:at + 16].hex(' ')}")
    print(f"({len(frame)} bytes)")
