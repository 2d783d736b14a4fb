"""Registered transfer buffers and their reservations, with accounting that proves nothing leaks."""
