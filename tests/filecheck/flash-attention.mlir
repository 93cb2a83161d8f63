// RUN: hspmd-opt %s -p fuse-kernels,device-kernels,flash-attention | filecheck %s

// Causal attention and its backward in one function, as autodiff writes them: after
// fuse-kernels and device-kernels, the scores' product, the scale + mask + softmax kernel and
// the product with v become one graph.flash_attention kernel (o and the rows' logsumexp); the
// backward's products, softmax gradient and masked scale become one graph.flash_attention_grad
// kernel reading the logsumexp and k as the forward does; dk comes out as it is, not
// transposed back, and k^T is not written out. No value of [B, T, T] is left.

builtin.module {
  func.func @attention(%q: tensor<2x6x8xf32>, %k: tensor<2x6x8xf32>, %v: tensor<2x6x8xf32>, %do: tensor<2x6x8xf32>) -> (tensor<2x6x8xf32>, tensor<2x6x8xf32>, tensor<2x6x8xf32>, tensor<2x6x8xf32>) {
    %kt = graph.transpose %k {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xf32>) -> tensor<2x8x6xf32>
    %s = graph.matmul %q, %kt : (tensor<2x6x8xf32>, tensor<2x8x6xf32>) -> tensor<2x6x6xf32>
    %ss = graph.scale %s {factor = 0.35355339059327373 : f64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %m = graph.causal_mask %ss {value = 0xFFF0000000000000 : f64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %p = graph.softmax %m {dim = 2 : i64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %o = graph.matmul %p, %v : (tensor<2x6x6xf32>, tensor<2x6x8xf32>) -> tensor<2x6x8xf32>
    %vt = graph.transpose %v {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xf32>) -> tensor<2x8x6xf32>
    %dp = graph.matmul %do, %vt : (tensor<2x6x8xf32>, tensor<2x8x6xf32>) -> tensor<2x6x6xf32>
    %pt = graph.transpose %p {perm = array<i64: 0, 2, 1>} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %dv = graph.matmul %pt, %do : (tensor<2x6x6xf32>, tensor<2x6x8xf32>) -> tensor<2x6x8xf32>
    %ds = graph.softmax_grad %p, %dp {dim = 2 : i64} : (tensor<2x6x6xf32>, tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %dm = graph.causal_mask %ds {value = 0.000000e+00 : f64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %dsc = graph.scale %dm {factor = 0.35355339059327373 : f64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %ktt = graph.transpose %kt {perm = array<i64: 0, 2, 1>} : (tensor<2x8x6xf32>) -> tensor<2x6x8xf32>
    %dq = graph.matmul %dsc, %ktt : (tensor<2x6x6xf32>, tensor<2x6x8xf32>) -> tensor<2x6x8xf32>
    %qt = graph.transpose %q {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xf32>) -> tensor<2x8x6xf32>
    %dkt = graph.matmul %qt, %dsc : (tensor<2x8x6xf32>, tensor<2x6x6xf32>) -> tensor<2x8x6xf32>
    %dk = graph.transpose %dkt {perm = array<i64: 0, 2, 1>} : (tensor<2x8x6xf32>) -> tensor<2x6x8xf32>
    func.return %o, %dq, %dk, %dv : tensor<2x6x8xf32>, tensor<2x6x8xf32>, tensor<2x6x8xf32>, tensor<2x6x8xf32>
  }
}

// CHECK-LABEL: func.func @attention
// CHECK-NOT:     tensor<2x6x6xf32>
// CHECK:         [[O:%.*]], [[LSE:%.*]] = "kernel.fused"(%q, %k, %v) <{kernel = "[[F:k[0-9]+]]_flash_attention", dtype = "f32", source = "{{.*}}HS_KERNEL void [[F]]_flash_attention_fwd({{.*}}", launches = ["row [[F]]_flash_attention_fwd 2 512"]
// CHECK:           "graph.flash_attention"({{.*}}) <{scale = 0.35355339059327373 : f64, causal = 1 : i64, k_transposed = 0 : i64, rate = 0.000000e+00 : f64, seed = 0 : i64, salt = 0 : i64}> : (tensor<2x6x8xf32>, tensor<2x6x8xf32>, tensor<2x6x8xf32>) -> (tensor<2x6x8xf32>, tensor<2x6xf32>)
// CHECK-NOT:     tensor<2x6x6xf32>
// CHECK:         [[DQ:%.*]], [[DK:%.*]], [[DV:%.*]] = "kernel.fused"(%q, %k, %v, [[O]], %do, [[LSE]]) <{kernel = "[[G:k[0-9]+]]_flash_attention_grad", dtype = "f32", {{.*}}launches = ["elementwise [[G]]_flash_attention_grad_dot 12 0", "row [[G]]_flash_attention_grad_dkv 2 512", "row [[G]]_flash_attention_grad_dq 2 512"], scratch = array<i64: 12>}>
// CHECK:           "graph.flash_attention_grad"({{.*}}) <{scale = 0.35355339059327373 : f64, causal = 1 : i64, k_transposed = 0 : i64,
// CHECK-NOT:     tensor<2x6x6xf32>
// CHECK-NOT:     graph.transpose
// CHECK:         func.return [[O]], [[DQ]], [[DK]], [[DV]] :

// The same in bfloat16, as a precision=bfloat16 program has it: the products, scale and mask in
// 16 bits, the softmax and its gradient in float32 between casts. The fused kernels store
// bf16 (hs_bf16) and a float32 logsumexp; no value of [B, T, T] is left, of either type.

builtin.module {
  func.func @attention_bf16(%q: tensor<2x6x8xbf16>, %k: tensor<2x6x8xbf16>, %v: tensor<2x6x8xbf16>, %do: tensor<2x6x8xbf16>) -> (tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>) {
    %kt = graph.transpose %k {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xbf16>) -> tensor<2x8x6xbf16>
    %s = graph.matmul %q, %kt : (tensor<2x6x8xbf16>, tensor<2x8x6xbf16>) -> tensor<2x6x6xbf16>
    %ss = graph.scale %s {factor = 0.35355339059327373 : f64} : (tensor<2x6x6xbf16>) -> tensor<2x6x6xbf16>
    %m = graph.causal_mask %ss {value = 0xFFF0000000000000 : f64} : (tensor<2x6x6xbf16>) -> tensor<2x6x6xbf16>
    %mf = graph.cast %m : (tensor<2x6x6xbf16>) -> tensor<2x6x6xf32>
    %p = graph.softmax %mf {dim = 2 : i64} : (tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %p16 = graph.cast %p : (tensor<2x6x6xf32>) -> tensor<2x6x6xbf16>
    %o = graph.matmul %p16, %v : (tensor<2x6x6xbf16>, tensor<2x6x8xbf16>) -> tensor<2x6x8xbf16>
    %vt = graph.transpose %v {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xbf16>) -> tensor<2x8x6xbf16>
    %dp = graph.matmul %do, %vt : (tensor<2x6x8xbf16>, tensor<2x8x6xbf16>) -> tensor<2x6x6xbf16>
    %pt = graph.transpose %p16 {perm = array<i64: 0, 2, 1>} : (tensor<2x6x6xbf16>) -> tensor<2x6x6xbf16>
    %dv = graph.matmul %pt, %do : (tensor<2x6x6xbf16>, tensor<2x6x8xbf16>) -> tensor<2x6x8xbf16>
    %dpf = graph.cast %dp : (tensor<2x6x6xbf16>) -> tensor<2x6x6xf32>
    %dsf = graph.softmax_grad %p, %dpf {dim = 2 : i64} : (tensor<2x6x6xf32>, tensor<2x6x6xf32>) -> tensor<2x6x6xf32>
    %ds = graph.cast %dsf : (tensor<2x6x6xf32>) -> tensor<2x6x6xbf16>
    %dm = graph.causal_mask %ds {value = 0.000000e+00 : f64} : (tensor<2x6x6xbf16>) -> tensor<2x6x6xbf16>
    %dsc = graph.scale %dm {factor = 0.35355339059327373 : f64} : (tensor<2x6x6xbf16>) -> tensor<2x6x6xbf16>
    %ktt = graph.transpose %kt {perm = array<i64: 0, 2, 1>} : (tensor<2x8x6xbf16>) -> tensor<2x6x8xbf16>
    %dq = graph.matmul %dsc, %ktt : (tensor<2x6x6xbf16>, tensor<2x6x8xbf16>) -> tensor<2x6x8xbf16>
    %qt = graph.transpose %q {perm = array<i64: 0, 2, 1>} : (tensor<2x6x8xbf16>) -> tensor<2x8x6xbf16>
    %dkt = graph.matmul %qt, %dsc : (tensor<2x8x6xbf16>, tensor<2x6x6xbf16>) -> tensor<2x8x6xbf16>
    %dk = graph.transpose %dkt {perm = array<i64: 0, 2, 1>} : (tensor<2x8x6xbf16>) -> tensor<2x6x8xbf16>
    func.return %o, %dq, %dk, %dv : tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>
  }
}

// CHECK-LABEL: func.func @attention_bf16
// CHECK-NOT:     tensor<2x6x6x
// CHECK:         [[O:%.*]], [[LSE:%.*]] = "kernel.fused"(%q, %k, %v) <{kernel = "[[F:k[0-9]+]]_flash_attention", dtype = "bf16", source = "{{.*}}HS_KERNEL void [[F]]_flash_attention_fwd(const hs_bf16* in0, const hs_bf16* in1, const hs_bf16* in2, hs_bf16* out0, float* out1,
// CHECK:           "graph.flash_attention"({{.*}}) {{.*}} : (tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>) -> (tensor<2x6x8xbf16>, tensor<2x6xf32>)
// CHECK-NOT:     tensor<2x6x6x
// CHECK:         [[DQ:%.*]], [[DK:%.*]], [[DV:%.*]] = "kernel.fused"(%q, %k, %v, [[O]], %do, [[LSE]]) <{kernel = "[[G:k[0-9]+]]_flash_attention_grad", dtype = "bf16",
// CHECK:           "graph.flash_attention_grad"({{.*}}) {{.*}} : (tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6xf32>) -> (tensor<2x6x8xbf16>, tensor<2x6x8xbf16>, tensor<2x6x8xbf16>)
// CHECK-NOT:     tensor<2x6x6x
// CHECK-NOT:     graph.transpose
// CHECK:         func.return [[O]], [[DQ]], [[DK]], [[DV]] :
