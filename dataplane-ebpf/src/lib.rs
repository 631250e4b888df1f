//! Library target so dataplane-user can list this crate as a build dependency (cargo then
//! rebuilds the embedded object when it changes). The programs live in the binary target.
#![no_std]
