// RUN: hspmd-opt %s -p 'adam{lr=0.001 weight_decay=0.01 decoupled=true}' | filecheck %s
// RUN: hspmd-opt %s -p 'adam{lr_input=true beta1=0.8}' | filecheck %s --check-prefix=INPUT

// Each "grad:NAME" output becomes one optim.adam of the parameter, its gradient, its two
// zero-initialised moments "opt.m.NAME" / "opt.v.NAME", the learning rate and the bias
// corrections 1 - beta**t; the new parameter and moments are assigned back. The bias
// corrections are made once for all parameters from the scalar states opt.beta1_pow and
// opt.beta2_pow (init ones, times beta every step); opt.step counts steps.

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
// CHECK:         [[LR:%.*]] = graph.constant {value = 1.000000e-03 : f64} : tensor<f64>
// CHECK-NEXT:    [[STEP:%.*]] = graph.parameter "opt.step" {init = "zeros"} : tensor<i64>
// CHECK-NEXT:    [[ONEI:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<i64>
// CHECK-NEXT:    [[STEP1:%.*]] = graph.add [[STEP]], [[ONEI]] : (tensor<i64>, tensor<i64>) -> tensor<i64>
// CHECK-NEXT:    graph.assign "opt.step", [[STEP1]] : tensor<i64>
// CHECK-NEXT:    [[ONE:%.*]] = graph.constant {value = 1.000000e+00 : f64} : tensor<f64>
// CHECK-NEXT:    [[P1:%.*]] = graph.parameter "opt.beta1_pow" {init = "ones"} : tensor<f64>
// CHECK-NEXT:    [[P1N:%.*]] = graph.scale [[P1]] {factor = 9.000000e-01 : f64} : (tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    graph.assign "opt.beta1_pow", [[P1N]] : tensor<f64>
// CHECK-NEXT:    [[BC1:%.*]] = graph.sub [[ONE]], [[P1N]] : (tensor<f64>, tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    [[P2:%.*]] = graph.parameter "opt.beta2_pow" {init = "ones"} : tensor<f64>
// CHECK-NEXT:    [[P2N:%.*]] = graph.scale [[P2]] {factor = 9.990000e-01 : f64} : (tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    graph.assign "opt.beta2_pow", [[P2N]] : tensor<f64>
// CHECK-NEXT:    [[BC2:%.*]] = graph.sub [[ONE]], [[P2N]] : (tensor<f64>, tensor<f64>) -> tensor<f64>
// CHECK-NEXT:    [[M:%.*]] = graph.parameter "opt.m.w" {init = "zeros"} : tensor<4x3xf32>
// CHECK-NEXT:    [[V:%.*]] = graph.parameter "opt.v.w" {init = "zeros"} : tensor<4x3xf32>
// CHECK-NEXT:    [[NW:%.*]], [[NM:%.*]], [[NV:%.*]] = optim.adam %w, %gw, [[M]], [[V]], [[LR]], [[BC1]], [[BC2]] {beta1 = 9.000000e-01 : f64, beta2 = 9.990000e-01 : f64, eps = 1.000000e-08 : f64, weight_decay = 1.000000e-02 : f64, decoupled = true} : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>, tensor<f64>, tensor<f64>, tensor<f64>) -> (tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>)
// CHECK-NEXT:    graph.assign "w", [[NW]] : tensor<4x3xf32>
// CHECK-NEXT:    graph.assign "opt.m.w", [[NM]] : tensor<4x3xf32>
// CHECK-NEXT:    graph.assign "opt.v.w", [[NV]] : tensor<4x3xf32>
// CHECK-NEXT:    [[MB:%.*]] = graph.parameter "opt.m.b" {init = "zeros"} : tensor<3xf32>
// CHECK-NEXT:    [[VB:%.*]] = graph.parameter "opt.v.b" {init = "zeros"} : tensor<3xf32>
// CHECK-NEXT:    [[NB:%.*]], [[NMB:%.*]], [[NVB:%.*]] = optim.adam %b, %gb, [[MB]], [[VB]], [[LR]], [[BC1]], [[BC2]]
// CHECK-NEXT:    graph.assign "b", [[NB]] : tensor<3xf32>
// CHECK-NEXT:    graph.assign "opt.m.b", [[NMB]] : tensor<3xf32>
// CHECK-NEXT:    graph.assign "opt.v.b", [[NVB]] : tensor<3xf32>
// CHECK-NEXT:    func.return

// INPUT:       [[LR:%.*]] = graph.input "lr" : tensor<f64>
// INPUT:       graph.scale {{%.*}} {factor = 8.000000e-01 : f64}
// INPUT:       optim.adam %w, %gw, {{%.*}}, {{%.*}}, [[LR]], {{.*}} {beta1 = 8.000000e-01 : f64, {{.*}}, decoupled = false}
// INPUT:       optim.adam %b, %gb, {{%.*}}, {{%.*}}, [[LR]],
