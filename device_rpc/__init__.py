"""Devices over TVM RPC: trackers, device descriptions, remote run, tuning, the emulated Arm64 device.

This layer moves files and runs TVM modules on devices; it never imports tightfit's API layer.
"""
