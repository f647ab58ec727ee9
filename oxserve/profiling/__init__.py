"""Localized feedback (BRIEF §3): where step time goes, op by op and layer by layer, under
which conditions, and how far each op runs from this machine's roofline (`oxserve profile`);
op microbenchmarks checked against plain references (`opbench`, `oxserve bench kernels`)."""
