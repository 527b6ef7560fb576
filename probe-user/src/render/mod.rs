//! What probe shows people (the layer issue 42 gathers the renderers into): for now the live
//! view of `probe trace` on a terminal.
pub mod live;
