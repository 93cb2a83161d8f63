// RUN: hspmd-opt %s -p 'sgd{lr=0.25}' | filecheck %s

// Each "grad:NAME" output becomes the update NAME <- NAME - lr * grad, stored with
// graph.assign; the gradient outputs are gone, other outputs stay.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %b = graph.parameter "b" {init = "zeros"} : tensor<3xf32>
    %l = graph.constant {value = 0.0 : f64} : tensor<f32>
    graph.output "loss", %l : tensor<f32>
    %gw = graph.constant {value = 1.0 : f64} : tensor<4x3xf32>
    graph.output "grad:w", %gw : tensor<4x3xf32>
    %gb = graph.constant {value = 2.0 : f64} : tensor<3xf32>
    graph.output "grad:b", %gb : tensor<3xf32>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         graph.output "loss", %l : tensor<f32>
// CHECK-NOT:     graph.output "grad:
// CHECK:         [[SW:%.*]] = graph.scale %gw {factor = -2.500000e-01 : f64} : (tensor<4x3xf32>) -> tensor<4x3xf32>
// CHECK-NEXT:    [[NW:%.*]] = graph.add %w, [[SW]] : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
// CHECK-NEXT:    graph.assign "w", [[NW]] : tensor<4x3xf32>
// CHECK-NEXT:    [[SB:%.*]] = graph.scale %gb {factor = -2.500000e-01 : f64} : (tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    [[NB:%.*]] = graph.add %b, [[SB]] : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
// CHECK-NEXT:    graph.assign "b", [[NB]] : tensor<3xf32>
// CHECK-NEXT:    func.return
// CHECK-NOT:     graph.output "grad:
