// RUN: hspmd-opt %s -p autodiff --split-input-file | filecheck %s

// The backward ops go after the forward ones, before func.return: d(loss)/d(loss) = 1,
// reduce_sum's gradient is a broadcast, matmul's right-hand gradient is x^T @ g; the
// input x gets no gradient and w's is output as "grad:w".

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
    %l = graph.reduce_sum %y {dims = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK-NEXT:    [[G:%.*]] = graph.broadcast [[ONE]] {dims = array<i64>} : (tensor<f32>) -> tensor<2x3xf32>
// CHECK-NEXT:    [[XT:%.*]] = graph.transpose %x {perm = array<i64: 1, 0>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
// CHECK-NEXT:    [[GW:%.*]] = graph.matmul [[XT]], [[G]] : (tensor<4x2xf32>, tensor<2x3xf32>) -> tensor<4x3xf32>
// CHECK-NEXT:    graph.output "grad:w", [[GW]] : tensor<4x3xf32>
// CHECK-NEXT:    func.return
// CHECK-NOT:     grad:x

// -----

// A value used twice (w * w) sums its two contributions with graph.add; relu's gradient is
// relu_grad at its input; a parameter the loss does not depend on gets a zero gradient.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "ones"} : tensor<3xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32>
    %m = graph.mul %w, %w : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
    %r = graph.relu %m : (tensor<3xf32>) -> tensor<3xf32>
    %l = graph.reduce_sum %r {dims = array<i64: 0>} : (tensor<3xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<f32>
// CHECK-NEXT:    [[G:%.*]] = graph.broadcast [[ONE]] {dims = array<i64>} : (tensor<f32>) -> tensor<3xf32>
// CHECK-NEXT:    [[GM:%.*]] = graph.relu_grad %m, [[G]] : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    [[A:%.*]] = graph.mul [[GM]], %w : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    [[B:%.*]] = graph.mul [[GM]], %w : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    [[GW:%.*]] = graph.add [[A]], [[B]] : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    graph.output "grad:w", [[GW]] : tensor<3xf32>
// CHECK-NEXT:    [[ZERO:%.*]] = graph.constant {value = 0.000000e+00 : f64} : tensor<3xf32>
// CHECK-NEXT:    graph.output "grad:b", [[ZERO]] : tensor<3xf32>
// CHECK-NEXT:    func.return
