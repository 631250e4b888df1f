//! The operator's commands that read a node rather than run it: `dataplane status` (what is
//! attached, how full each map is, the counters), `dataplane inspect` (the maps' contents,
//! decoded) and `dataplane trace` (one packet through the real programs against copies of the
//! node's maps). Each reads the pins and the run directory; none needs a running agent.

pub mod inspect;
pub mod status;
pub mod trace;
