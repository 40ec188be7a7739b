"""Accuracy of the MpFA numerics: kernel error on real activations, tasks, logits, served scores and emulation."""
