"""Fakes of mori and aiter, injected through sys.modules by tests/rocm/conftest.py only.

They restate the published Python APIs (sources and versions in docs/rocm.md) and record every
call; no fake is imported by megamoe_backend itself.
"""
