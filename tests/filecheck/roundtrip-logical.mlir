// RUN: hspmd-opt %s | hspmd-opt | filecheck %s

// Logical IR prints and parses back unchanged: every graph op, global shapes, no layout.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "uniform:-0.5:0.5"} : tensor<4x6xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %y = graph.input "y" : tensor<2xi32>
    %c = graph.constant {value = 0.5 : f64} : tensor<2x6xf32>
    %m = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x6xf32>) -> tensor<2x6xf32>
    %a = graph.add %m, %c : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
    %s = graph.sub %a, %c : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
    %p = graph.mul %s, %a : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
    %r = graph.relu %p : (tensor<2x6xf32>) -> tensor<2x6xf32>
    %rg = graph.relu_grad %p, %r : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
    %k = graph.scale %rg {factor = 2.0 : f64} : (tensor<2x6xf32>) -> tensor<2x6xf32>
    %t = graph.transpose %k {perm = array<i64: 1, 0>} : (tensor<2x6xf32>) -> tensor<6x2xf32>
    %v = graph.reshape %t : (tensor<6x2xf32>) -> tensor<3x4xf32>
    %rs = graph.reduce_sum %v {dims = array<i64: 1>} : (tensor<3x4xf32>) -> tensor<3xf32>
    %b = graph.broadcast %rs {dims = array<i64: 0>} : (tensor<3xf32>) -> tensor<3x2xf32>
    %lg = graph.reshape %b : (tensor<3x2xf32>) -> tensor<2x3xf32>
    %ce = graph.softmax_cross_entropy %lg, %y : (tensor<2x3xf32>, tensor<2xi32>) -> tensor<2xf32>
    %ceg = graph.softmax_cross_entropy_grad %lg, %y, %ce : (tensor<2x3xf32>, tensor<2xi32>, tensor<2xf32>) -> tensor<2x3xf32>
    graph.output "ceg", %ceg : tensor<2x3xf32>
    graph.assign "w", %w : tensor<4x6xf32>
    func.return
  }
}

// CHECK:     builtin.module {
// CHECK-NEXT:  func.func @train_step() {
// CHECK-NEXT:    %w = graph.parameter "w" {init = "uniform:-0.5:0.5"} : tensor<4x6xf32>
// CHECK-NEXT:    %x = graph.input "x" : tensor<2x4xf32>
// CHECK-NEXT:    %y = graph.input "y" : tensor<2xi32>
// CHECK-NEXT:    %c = graph.constant {value = 5.000000e-01 : f64} : tensor<2x6xf32>
// CHECK-NEXT:    %m = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %a = graph.add %m, %c : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %s = graph.sub %a, %c : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %p = graph.mul %s, %a : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %r = graph.relu %p : (tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %rg = graph.relu_grad %p, %r : (tensor<2x6xf32>, tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %k = graph.scale %rg {factor = 2.000000e+00 : f64} : (tensor<2x6xf32>) -> tensor<2x6xf32>
// CHECK-NEXT:    %t = graph.transpose %k {perm = array<i64: 1, 0>} : (tensor<2x6xf32>) -> tensor<6x2xf32>
// CHECK-NEXT:    %v = graph.reshape %t : (tensor<6x2xf32>) -> tensor<3x4xf32>
// CHECK-NEXT:    %rs = graph.reduce_sum %v {dims = array<i64: 1>} : (tensor<3x4xf32>) -> tensor<3xf32>
// CHECK-NEXT:    %b = graph.broadcast %rs {dims = array<i64: 0>} : (tensor<3xf32>) -> tensor<3x2xf32>
// CHECK-NEXT:    %lg = graph.reshape %b : (tensor<3x2xf32>) -> tensor<2x3xf32>
// CHECK-NEXT:    %ce = graph.softmax_cross_entropy %lg, %y : (tensor<2x3xf32>, tensor<2xi32>) -> tensor<2xf32>
// CHECK-NEXT:    %ceg = graph.softmax_cross_entropy_grad %lg, %y, %ce : (tensor<2x3xf32>, tensor<2xi32>, tensor<2xf32>) -> tensor<2x3xf32>
// CHECK-NEXT:    graph.output "ceg", %ceg : tensor<2x3xf32>
// CHECK-NEXT:    graph.assign "w", %w : tensor<4x6xf32>
// CHECK-NEXT:    func.return
// CHECK-NEXT:  }
// CHECK-NEXT:}
