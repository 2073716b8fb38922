"""Plain-numpy definitions the tests compare against (independent of jaxbnn and of XLA)."""

import numpy as np


def numpy_conv(x, w, stride, padding, pad_value):
    """Direct float convolution of ±1 NHWC x with HWIO w, tap by tap; "one" pads with -1, "zero" with 0."""
    (pt, pb), (pl, pr) = padding
    x = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=-1.0 if pad_value == "one" else 0.0)
    kh, kw, _, o = w.shape
    sh, sw = stride
    oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    out = np.zeros((x.shape[0], oh, ow, o), np.float64)
    for i in range(kh):
        for j in range(kw):
            out += x[:, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw, :] @ w[i, j]
    return out.astype(np.int32)
