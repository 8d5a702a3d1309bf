"""Run-time state of compiled HOT graphs: per-site choices made while training (LQS
scaling, HLA rank), read by the op bodies. It lives below the passes (which only register
sites here), so kernels never import passes."""
