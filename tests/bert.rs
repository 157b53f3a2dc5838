//! BERT encoder tests (being written).
