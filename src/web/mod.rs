//! The AM's web dashboard and status API (placeholder).
