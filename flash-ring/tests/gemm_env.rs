//! `FLASH_RING_GEMM` is read once per process, so its bad value has a test binary of its own:
//! every product under the default choice (`Gemm::Auto`) fails with an error naming the
//! variable, its value and the choices, and never panics; an explicit choice is unaffected.

use candle_core::{DType, Device, Tensor};
use flash_ring::{Gemm, KernelConfig};

#[test]
fn a_bad_flash_ring_gemm_is_an_error_naming_it() {
    // This binary's only test sets the variable before any product reads it.
    std::env::set_var(flash_ring::cpu::mkl::GEMM_ENV, "blis");
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).expect("x");
    let w = Tensor::ones((3, 4), DType::F32, &Device::Cpu).expect("w");
    let e = flash_ring::matmul(&x, &w)
        .expect_err("bad variable")
        .to_string();
    assert!(
        e.contains("FLASH_RING_GEMM=\"blis\"") && e.contains("auto, native or mkl"),
        "{e}"
    );
    let native = KernelConfig {
        gemm: Gemm::Native,
        ..KernelConfig::default()
    };
    let y = flash_ring::matmul_with_config(&x, &w, &native).expect("an explicit choice");
    assert_eq!(y.to_vec2::<f32>().expect("y"), vec![vec![3.0f32; 4]; 2]);
}
