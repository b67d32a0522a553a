//! Integration tests (filled in below).
