"""Attention kernel and serving profiles: kernels side by side at one shape, Nsight captures, the fp8 prefill
kernel's ablations and a live server's GPU-time breakdown. Builds on `mpfa.mpfa_cli.harness`; `mpfa profile` is its
command-line front end."""
