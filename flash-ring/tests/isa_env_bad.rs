//! A `FLASH_RING_ISA` that names no instruction set is an error naming the variable at every
//! kernel call under the default choice, never a panic; an explicit ISA is unaffected.

use candle_core::{DType, Device, Tensor};
use flash_ring::{AttnSpec, KernelConfig, MaskKind};

#[test]
fn a_bad_flash_ring_isa_is_an_error_naming_it() {
    // This binary's only test sets the variable before any kernel reads it.
    std::env::set_var(flash_ring::cpu::ISA_ENV, "sse4");
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).expect("x");
    let e = flash_ring::matmul(&x, &x.t().expect("t"))
        .expect_err("bad variable")
        .to_string();
    assert!(
        e.contains("FLASH_RING_ISA=\"sse4\"") && e.contains("avx512, avx2 or portable"),
        "{e}"
    );
    let q = Tensor::ones((1, 4, 1, 8), DType::F32, &Device::Cpu).expect("q");
    let spec = AttnSpec::dense(0.5, MaskKind::Causal, 4, 4);
    let e = flash_ring::flash_fwd_with_config(&q, &q, &q, &spec, &KernelConfig::default())
        .expect_err("bad variable")
        .to_string();
    assert!(e.contains("FLASH_RING_ISA"), "{e}");
    let portable = KernelConfig {
        isa: Some(flash_ring::Isa::Portable),
        ..KernelConfig::default()
    };
    flash_ring::flash_fwd_with_config(&q, &q, &q, &spec, &portable).expect("an explicit ISA");
}
