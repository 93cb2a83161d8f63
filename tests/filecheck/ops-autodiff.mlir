// RUN: hspmd-opt %s -p autodiff --split-input-file | filecheck %s

// layer_norm's backward is one multi-result op (dx, dweight, dbias); the input x needs no
// gradient, so only dweight and dbias are used.

builtin.module {
  func.func @train_step() {
    %x = graph.input "x" : tensor<4x2x8xf32>
    %g = graph.parameter "g" {init = "ones"} : tensor<8xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<8xf32>
    %y = graph.layer_norm %x, %g, %b {eps = 1.000000e-05 : f64} : (tensor<4x2x8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<4x2x8xf32>
    %l = graph.reduce_sum %y {dims = array<i64: 0, 1, 2>} : (tensor<4x2x8xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK-NEXT:    [[G:%.*]] = graph.broadcast [[ONE]] {dims = array<i64>} : (tensor<f32>) -> tensor<4x2x8xf32>
// CHECK-NEXT:    [[DX:%.*]], [[DG:%.*]], [[DB:%.*]] = graph.layer_norm_grad %x, %g, [[G]] {eps = 1.000000e-05 : f64} : (tensor<4x2x8xf32>, tensor<8xf32>, tensor<4x2x8xf32>) -> (tensor<4x2x8xf32>, tensor<8xf32>, tensor<8xf32>)
// CHECK-NEXT:    graph.output "grad:g", [[DG]] : tensor<8xf32>
// CHECK-NEXT:    graph.output "grad:b", [[DB]] : tensor<8xf32>
// CHECK-NEXT:    func.return

// -----

// A weight applied to batched activations: its gradient contracts the batch dims
// (matmul_rhs_grad). The unused piece of a split gets a zero gradient (a constant), joined
// with the used piece's by concat; reduce_max and softmax have dedicated gradient ops.

builtin.module {
  func.func @train_step() {
    %x = graph.input "x" : tensor<2x3x4xf32>
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x5xf32>
    %y = graph.matmul %x, %w : (tensor<2x3x4xf32>, tensor<4x5xf32>) -> tensor<2x3x5xf32>
    %p, %q = graph.split %y {dim = 2 : i64} : (tensor<2x3x5xf32>) -> (tensor<2x3x2xf32>, tensor<2x3x3xf32>)
    %s = graph.softmax %q {dim = 2 : i64} : (tensor<2x3x3xf32>) -> tensor<2x3x3xf32>
    %l = graph.reduce_max %s {dims = array<i64: 0, 1, 2>} : (tensor<2x3x3xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK-NEXT:    [[GS:%.*]] = graph.reduce_max_grad %s, %l, [[ONE]] {dims = array<i64: 0, 1, 2>} : (tensor<2x3x3xf32>, tensor<f32>, tensor<f32>) -> tensor<2x3x3xf32>
// CHECK-NEXT:    [[GQ:%.*]] = graph.softmax_grad %s, [[GS]] {dim = 2 : i64} : (tensor<2x3x3xf32>, tensor<2x3x3xf32>) -> tensor<2x3x3xf32>
// CHECK-NEXT:    [[GP:%.*]] = graph.constant {value = 0.000000e+00 : f64} : tensor<2x3x2xf32>
// CHECK-NEXT:    [[GY:%.*]] = graph.concat [[GP]], [[GQ]] {dim = 2 : i64} : (tensor<2x3x2xf32>, tensor<2x3x3xf32>) -> tensor<2x3x5xf32>
// CHECK-NEXT:    [[GW:%.*]] = graph.matmul_rhs_grad %x, [[GY]] : (tensor<2x3x4xf32>, tensor<2x3x5xf32>) -> tensor<4x5xf32>
// CHECK-NEXT:    graph.output "grad:w", [[GW]] : tensor<4x5xf32>
// CHECK-NEXT:    func.return
